//! What is wrong with a policy, field by field: the one error type of validation and compilation.

use std::fmt;

/// One problem in a policy, at a field path such as `spec.rules[1].limit.per`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {message}")]
pub struct FieldError {
    pub path: String,
    pub message: String,
}

/// Every problem found in a policy (never empty when returned as an error).
#[derive(Clone, Debug, Default, PartialEq, Eq, thiserror::Error)]
pub struct ValidationErrors {
    pub errors: Vec<FieldError>,
}

impl fmt::Display for ValidationErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.errors.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl ValidationErrors {
    pub(crate) fn push(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.errors.push(FieldError { path: path.into(), message: message.into() });
    }
    pub fn is_empty(&self) -> bool {
        self.errors.is_empty()
    }
    pub fn iter(&self) -> impl Iterator<Item = &FieldError> {
        self.errors.iter()
    }
}
