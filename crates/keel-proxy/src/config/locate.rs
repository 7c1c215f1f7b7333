//! Where a configuration error is: the TOML document's key paths with their spans (toml_edit),
//! so that a serde error or a failed check ([`InvalidField`]) becomes `file:line:col: key: message`.

use std::fmt;
use std::ops::Range;

use keel_balance::{FieldPath, InvalidField, PathSegment, Problem};

/// A configuration error: where it is and what is wrong.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub struct ConfigError {
    /// The file (or other origin) of the configuration.
    pub origin: String,
    /// 1-based line, when known.
    pub line: Option<usize>,
    /// 1-based column, when known.
    pub column: Option<usize>,
    /// Dotted key path, e.g. `cluster[0].retry.attempts`, when known.
    pub key: Option<String>,
    /// What is wrong and what is allowed.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.origin)?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
            if let Some(col) = self.column {
                write!(f, ":{col}")?;
            }
        }
        if let Some(key) = &self.key {
            write!(f, ": `{key}`")?;
        }
        write!(f, ": {}", self.message)
    }
}

/// "must be greater than zero" for a duration key.
pub(crate) fn zero(key: &'static str) -> InvalidField {
    InvalidField::at(key, Problem::out_of_range("greater than zero", "0s"))
}

/// "must be at least 1" for a count key.
pub(crate) fn none(key: &'static str) -> InvalidField {
    InvalidField::at(key, Problem::out_of_range("at least 1", 0))
}

/// A key path and the span of its key and value (or table header) in the text.
struct Located {
    path: String,
    span: Range<usize>,
}

fn push_key(path: &[String], key: &str) -> Vec<String> {
    let mut p = path.to_vec();
    p.push(key.to_string());
    p
}

fn path_string(path: &[String]) -> String {
    let mut s = String::new();
    for p in path {
        if p.starts_with('[') {
            s.push_str(p);
        } else {
            if !s.is_empty() {
                s.push('.');
            }
            s.push_str(p);
        }
    }
    s
}

fn collect_item(item: &toml_edit::Item, path: &mut Vec<String>, out: &mut Vec<Located>) {
    match item {
        toml_edit::Item::Table(t) => collect_table(t, path, out),
        toml_edit::Item::ArrayOfTables(a) => {
            for (i, t) in a.iter().enumerate() {
                path.push(format!("[{i}]"));
                if let Some(span) = t.span() {
                    out.push(Located {
                        path: path_string(path),
                        span,
                    });
                }
                collect_table(t, path, out);
                path.pop();
            }
        }
        toml_edit::Item::Value(v) => collect_value(v, path, out),
        toml_edit::Item::None => {}
    }
}

fn collect_table(t: &toml_edit::Table, path: &[String], out: &mut Vec<Located>) {
    for (k, item) in t.iter() {
        let Some((key, _)) = t.get_key_value(k) else {
            continue;
        };
        let sub = push_key(path, k);
        let start = key.span().map(|s| s.start).or(item.span().map(|s| s.start));
        let end = item.span().map(|s| s.end).or(key.span().map(|s| s.end));
        if let (Some(start), Some(end)) = (start, end) {
            out.push(Located {
                path: path_string(&sub),
                span: start..end.max(start),
            });
        } else if let toml_edit::Item::Table(sub_t) = item {
            if let Some(span) = sub_t.span() {
                out.push(Located {
                    path: path_string(&sub),
                    span,
                });
            }
        }
        let mut sub = sub;
        collect_item(item, &mut sub, out);
    }
}

fn collect_value(v: &toml_edit::Value, path: &mut Vec<String>, out: &mut Vec<Located>) {
    match v {
        toml_edit::Value::Array(a) => {
            for (i, v) in a.iter().enumerate() {
                path.push(format!("[{i}]"));
                if let Some(span) = v.span() {
                    out.push(Located {
                        path: path_string(path),
                        span,
                    });
                }
                collect_value(v, path, out);
                path.pop();
            }
        }
        toml_edit::Value::InlineTable(t) => {
            for (k, _) in t.iter() {
                let Some((key, item)) = t.get_key_value(k) else {
                    continue;
                };
                let mut sub = push_key(path, k);
                let start = key.span().map(|s| s.start).or(item.span().map(|s| s.start));
                let end = item.span().map(|s| s.end);
                if let (Some(start), Some(end)) = (start, end) {
                    out.push(Located {
                        path: path_string(&sub),
                        span: start..end.max(start),
                    });
                }
                collect_item(item, &mut sub, out);
            }
        }
        _ => {}
    }
}

/// The key path whose text contains `offset`: the narrowest span that contains it, or else the
/// nearest one before it.
fn key_at(index: &[Located], offset: usize) -> Option<String> {
    index
        .iter()
        .filter(|l| l.span.start <= offset && offset < l.span.end.max(l.span.start + 1))
        .min_by_key(|l| l.span.end - l.span.start)
        .or_else(|| {
            index
                .iter()
                .filter(|l| l.span.start <= offset)
                .max_by_key(|l| l.span.start)
        })
        .map(|l| l.path.clone())
}

/// The span of a key path, or of its longest prefix present in the text (a key left to its
/// default is reported at its table).
fn span_of(index: &[Located], path: &FieldPath) -> (Option<Range<usize>>, String) {
    let strings: Vec<String> = path
        .segments()
        .iter()
        .map(|s| match s {
            PathSegment::Key(k) => k.to_string(),
            PathSegment::Index(i) => format!("[{i}]"),
        })
        .collect();
    let full = path_string(&strings);
    for n in (1..=strings.len()).rev() {
        let p = path_string(&strings[..n]);
        if let Some(l) = index.iter().find(|l| l.path == p) {
            return (Some(l.span.clone()), full);
        }
    }
    (None, full)
}

/// 1-based line and column of a byte offset.
fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(text.len());
    let before = &text[..offset];
    let line = before.matches('\n').count() + 1;
    let col = before.rfind('\n').map_or(offset, |p| offset - p - 1) + 1;
    (line, col)
}

/// A configuration's text, indexed by key path: locates the errors found in it.
pub(crate) struct Document<'a> {
    text: &'a str,
    origin: &'a str,
    index: Vec<Located>,
}

impl<'a> Document<'a> {
    /// Indexes `text`, or says where it is not TOML.
    pub(crate) fn parse(text: &'a str, origin: &'a str) -> Result<Self, ConfigError> {
        let doc = Document {
            text,
            origin,
            index: Vec::new(),
        };
        match toml_edit::ImDocument::parse(text) {
            Ok(parsed) => {
                let mut index = Vec::new();
                collect_item(parsed.as_item(), &mut Vec::new(), &mut index);
                Ok(Document { index, ..doc })
            }
            Err(e) => Err(doc.at(
                e.span(),
                None,
                format!("invalid TOML: {}", e.message().trim()),
            )),
        }
    }

    /// A serde error, at the key its span falls in.
    pub(crate) fn serde_error(&self, e: &toml::de::Error) -> ConfigError {
        let span = e.span();
        let key = span.as_ref().and_then(|s| key_at(&self.index, s.start));
        self.at(span, key, e.message().trim().to_string())
    }

    /// A failed check, at its key (or the nearest table present in the text).
    pub(crate) fn error(&self, e: &InvalidField) -> ConfigError {
        let (span, key) = span_of(&self.index, &e.field);
        let key = (!key.is_empty()).then_some(key);
        self.at(span, key, e.problem.to_string())
    }

    fn at(&self, span: Option<Range<usize>>, key: Option<String>, message: String) -> ConfigError {
        let (line, column) = span
            .map(|s| line_col(self.text, s.start))
            .map_or((None, None), |(l, c)| (Some(l), Some(c)));
        ConfigError {
            origin: self.origin.to_string(),
            line,
            column,
            key,
            message,
        }
    }
}
