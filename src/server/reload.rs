//! When a polled file's new content may be loaded. Shared by the policy files (`sluice serve`)
//! and the token file, so both read an edit the same way.
//!
//! A file written in place (`cp`, shell redirection, `std::fs::write`, many editors) is first
//! truncated, then written: a poll between the two reads an empty or half-written file. An empty
//! policy file is valid and enforces nothing, and an empty token file admits no caller, so
//! loading it would lift every limit, or refuse every caller, until the next poll. A change is
//! therefore loaded only once two consecutive polls read the same new content: the files have
//! stood still for one interval. Edits that replace the file atomically (a rename, a ConfigMap's
//! symlink swap) take one interval longer to go live, and nothing else changes.

/// The content last loaded, and a change seen once and not yet confirmed, by fingerprint.
#[derive(Debug)]
pub struct SettledChange {
    loaded: Vec<u8>,
    unconfirmed: Option<Vec<u8>>,
}

impl SettledChange {
    /// Starts from the fingerprint of the content loaded at start-up.
    pub fn new(loaded: Vec<u8>) -> SettledChange {
        SettledChange { loaded, unconfirmed: None }
    }

    /// Takes this poll's fingerprint; true when that content is to be loaded now (from then on it
    /// counts as loaded, whether or not it turns out valid).
    pub fn poll(&mut self, current: Vec<u8>) -> bool {
        if current == self.loaded {
            self.unconfirmed = None;
            return false;
        }
        if self.unconfirmed.as_ref() == Some(&current) {
            self.loaded = current;
            self.unconfirmed = None;
            return true;
        }
        self.unconfirmed = Some(current);
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(text: &str) -> Vec<u8> {
        text.as_bytes().to_vec()
    }

    #[test]
    fn a_change_is_loaded_once_two_polls_agree() {
        let mut change = SettledChange::new(fp("v1"));
        assert!(!change.poll(fp("v1")));
        assert!(!change.poll(fp("v2")), "seen once");
        assert!(change.poll(fp("v2")), "seen twice in a row");
        assert!(!change.poll(fp("v2")), "already loaded");
    }

    #[test]
    fn a_file_caught_half_way_through_a_write_is_never_loaded() {
        let mut change = SettledChange::new(fp("v1"));
        // Truncated, then written: each poll sees another content until the write is done.
        assert!(!change.poll(fp("")));
        assert!(!change.poll(fp("v2, half")));
        assert!(!change.poll(fp("v2, whole")));
        assert!(change.poll(fp("v2, whole")));
    }

    #[test]
    fn a_change_undone_before_it_settles_loads_nothing() {
        let mut change = SettledChange::new(fp("v1"));
        assert!(!change.poll(fp("")));
        assert!(!change.poll(fp("v1")));
        assert!(!change.poll(fp("")), "seen once again: the earlier sighting does not count");
    }
}
