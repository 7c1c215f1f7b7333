//! The vocabulary of configuration errors: which field ([`FieldPath`]) and what is wrong with
//! it ([`Problem`]), together an [`InvalidField`]. Every configuration of keel validates into
//! it; the edge turns it into text.

use std::fmt;

/// A path to a configuration field, relative to the value that was validated: keys and list
/// indices, written `outlier_detection.failure_rate.threshold_percent` or `endpoints[1].weight`.
/// The same path names the key in TOML, so a caller that embeds the value (the proxy's
/// `[[cluster]]`) prefixes its own path and finds the key's line.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct FieldPath(Vec<PathSegment>);

/// One step of a [`FieldPath`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PathSegment {
    /// A key of a table.
    Key(&'static str),
    /// An index into a list.
    Index(usize),
}

impl FieldPath {
    /// The path of one key.
    pub fn key(key: &'static str) -> Self {
        FieldPath(vec![PathSegment::Key(key)])
    }

    /// The empty path: the validated value itself.
    pub fn root() -> Self {
        FieldPath(Vec::new())
    }

    /// This path with a key appended.
    pub fn then(mut self, key: &'static str) -> Self {
        self.0.push(PathSegment::Key(key));
        self
    }

    /// This path with a list index appended.
    pub fn at(mut self, index: usize) -> Self {
        self.0.push(PathSegment::Index(index));
        self
    }

    /// `prefix` followed by this path (how an enclosing value reports a nested field).
    pub fn under(mut self, prefix: FieldPath) -> Self {
        let mut p = prefix.0;
        p.append(&mut self.0);
        self.0 = p;
        self
    }

    /// The steps, outermost first.
    pub fn segments(&self) -> &[PathSegment] {
        &self.0
    }
}

impl fmt::Display for FieldPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, s) in self.0.iter().enumerate() {
            match s {
                PathSegment::Key(k) if i == 0 => f.write_str(k)?,
                PathSegment::Key(k) => write!(f, ".{k}")?,
                PathSegment::Index(n) => write!(f, "[{n}]")?,
            }
        }
        Ok(())
    }
}

/// What is wrong with a field's value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Problem {
    /// The value is outside what is allowed: "must be {must_be}, got {got}".
    OutOfRange {
        /// What the value must be, e.g. `within 0..=100`, `greater than zero`.
        must_be: String,
        /// The value given.
        got: String,
    },
    /// The field does not apply here, and why (e.g. to this strategy).
    NotApplicable(String),
    /// The value repeats an earlier one (an endpoint listed twice).
    Duplicate(String),
    /// Anything else, in words (a malformed address, a reference to nothing).
    Invalid(String),
}

impl Problem {
    /// `OutOfRange` from anything printable.
    pub fn out_of_range(must_be: impl Into<String>, got: impl fmt::Display) -> Self {
        Problem::OutOfRange {
            must_be: must_be.into(),
            got: got.to_string(),
        }
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::OutOfRange { must_be, got } => write!(f, "must be {must_be}, got {got}"),
            Problem::NotApplicable(why) => write!(f, "does not apply: {why}"),
            Problem::Duplicate(what) => write!(f, "`{what}` is listed twice"),
            Problem::Invalid(why) => f.write_str(why),
        }
    }
}

/// A configuration value that is refused: which field, and what is wrong with it. Every
/// `validate` of keel's configurations returns it; the edge (a CLI, the proxy's loader) turns it
/// into text, with the file and line when it has them.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {problem}")]
pub struct InvalidField {
    /// Where, relative to the value validated.
    pub field: FieldPath,
    /// What is wrong.
    pub problem: Problem,
}

impl InvalidField {
    /// The error for `field`.
    pub fn new(field: FieldPath, problem: Problem) -> Self {
        InvalidField { field, problem }
    }

    /// The error for one key of the value validated.
    pub fn at(key: &'static str, problem: Problem) -> Self {
        InvalidField::new(FieldPath::key(key), problem)
    }

    /// The same error seen from an enclosing value, whose path to this one is `prefix`.
    pub fn under(self, prefix: FieldPath) -> Self {
        InvalidField {
            field: self.field.under(prefix),
            problem: self.problem,
        }
    }
}
