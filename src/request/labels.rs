//! Workload labels written as a list, `k=v[,k=v…]`: the sidecar's `--labels` flag and the ext_authz
//! mode's `x-sluice-labels` header read the same syntax the same way.

use std::collections::BTreeMap;

/// `k=v,k2=v2` (spaces around items ignored; an empty list is no labels; an empty key is refused).
pub fn parse_label_list(text: &str) -> Result<BTreeMap<String, String>, String> {
    let mut labels = BTreeMap::new();
    for item in text.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let (k, v) = item.split_once('=').ok_or_else(|| format!("expected key=value pairs, got {item:?}"))?;
        let k = k.trim();
        if k.is_empty() {
            return Err(format!("empty key in {item:?}"));
        }
        labels.insert(k.to_string(), v.trim().to_string());
    }
    Ok(labels)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_lists() {
        let l = parse_label_list(" app=orders , tier=web,").unwrap();
        assert_eq!(l.get("app").map(String::as_str), Some("orders"));
        assert_eq!(l.get("tier").map(String::as_str), Some("web"));
        assert!(parse_label_list("").unwrap().is_empty());
        assert!(parse_label_list("app").unwrap_err().contains("key=value"));
        assert!(parse_label_list("=x").is_err());
        assert_eq!(parse_label_list("a=").unwrap()["a"], "", "an empty value is a value");
    }
}
