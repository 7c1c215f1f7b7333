//! A log format as literal text between named fields (NGINX's `$variable`, Envoy's
//! `%COMMAND%`), built once and used to split each line into its fields' values.

use super::log::LineError;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Literal(String),
    Field(String),
}

/// Literal text and fields, in order; two fields never follow each other (a line could not be
/// split there).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Template {
    pieces: Vec<Piece>,
    open: String,
}

impl Template {
    pub(crate) fn literal(&mut self, c: char) {
        self.open.push(c);
    }

    /// Adds a field; with no text since the last field, `Err` holds the two fields' names.
    pub(crate) fn field(&mut self, name: &str) -> Result<(), (String, String)> {
        if !self.open.is_empty() {
            self.pieces
                .push(Piece::Literal(std::mem::take(&mut self.open)));
        }
        if let Some(Piece::Field(prev)) = self.pieces.last() {
            return Err((prev.clone(), name.to_string()));
        }
        self.pieces.push(Piece::Field(name.to_string()));
        Ok(())
    }

    /// Closes the trailing text; call once, after the last piece.
    pub(crate) fn finish(mut self) -> Template {
        if !self.open.is_empty() {
            self.pieces
                .push(Piece::Literal(std::mem::take(&mut self.open)));
        }
        self
    }

    pub(crate) fn has(&self, name: &str) -> bool {
        self.pieces
            .iter()
            .any(|p| matches!(p, Piece::Field(f) if f == name))
    }

    /// Splits a line into `(field, value)` pairs, or says where it departs from the format.
    /// A field's value runs to the next literal text (or the line's end) unless `width` gives
    /// its length from the rest of the line; `shown` writes a field's name as the format does.
    pub(crate) fn split<'a>(
        &'a self,
        line: &'a str,
        shown: impl Fn(&str) -> String,
        width: impl Fn(&str, &str) -> Option<usize>,
    ) -> Result<Vec<(&'a str, &'a str)>, LineError> {
        let mut out = Vec::new();
        let mut pos = 0;
        for (k, piece) in self.pieces.iter().enumerate() {
            let rest = &line[pos..];
            let len = match piece {
                Piece::Literal(l) => {
                    if !rest.starts_with(l.as_str()) {
                        return Err(LineError::shape(format!(
                            "expected {l:?} at column {}",
                            pos + 1
                        )));
                    }
                    l.len()
                }
                Piece::Field(f) => {
                    let len = match (width(f, rest), self.pieces.get(k + 1)) {
                        (Some(len), _) => len.min(rest.len()),
                        (None, Some(Piece::Literal(l))) => {
                            rest.find(l.as_str()).ok_or_else(|| {
                                LineError::shape(format!(
                                    "no {l:?} after {} (column {})",
                                    shown(f),
                                    pos + 1
                                ))
                            })?
                        }
                        (None, _) => rest.len(),
                    };
                    out.push((f.as_str(), &rest[..len]));
                    len
                }
            };
            pos += len;
        }
        if pos != line.len() {
            return Err(LineError::shape(format!(
                "{} characters left after the format's end (column {})",
                line.len() - pos,
                pos + 1
            )));
        }
        Ok(out)
    }
}
