//! `compression = true` (or a table of its settings) on a route or a cluster: the responses keel
//! compresses for clients that accept it (gzip, brotli, zstd).

use keel_balance::{FieldPath, InvalidField, Problem};
use serde::Deserialize;

/// A content coding keel compresses with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum Coding {
    /// `gzip` (DEFLATE in the gzip format).
    #[serde(rename = "gzip")]
    Gzip,
    /// `br` (brotli).
    #[serde(rename = "br")]
    Brotli,
    /// `zstd` (Zstandard).
    #[serde(rename = "zstd")]
    Zstd,
}

impl Coding {
    /// The coding's token, as `Accept-Encoding` and `Content-Encoding` spell it.
    pub fn token(self) -> &'static str {
        match self {
            Coding::Gzip => "gzip",
            Coding::Brotli => "br",
            Coding::Zstd => "zstd",
        }
    }
}

/// `compression = true`, `false`, or `{ algorithms, gzip_level, brotli_level, zstd_level,
/// min_length, types }`. A route's setting replaces its cluster's (`false` turns it off).
#[derive(Debug, Clone, PartialEq)]
pub struct CompressionConfig {
    /// Whether keel compresses at all (`compression = false`: no, whatever the cluster says).
    pub enabled: bool,
    /// The codings keel offers, preferred first when the client weighs several alike.
    pub algorithms: Vec<Coding>,
    /// gzip's level, 1 (fastest, NGINX's `gzip_comp_level` default) to 9.
    pub gzip_level: u32,
    /// brotli's quality, 0 to 11.
    pub brotli_level: u32,
    /// zstd's level, 1 to 19.
    pub zstd_level: i32,
    /// Responses whose `Content-Length` is below this are sent as they are (a body of unknown
    /// length is compressed).
    pub min_length: u64,
    /// The media types compressed (`text/html`; `text/*` for a whole type; `*` for all).
    pub types: Vec<String>,
}

/// The media types compressed by default: Envoy's compressor list, with the other names of
/// JavaScript and XML. Not `text/event-stream` (see the docs: it can be added).
pub const DEFAULT_TYPES: &[&str] = &[
    "text/html",
    "text/plain",
    "text/css",
    "text/xml",
    "text/javascript",
    "application/javascript",
    "application/json",
    "application/xml",
    "application/xhtml+xml",
    "image/svg+xml",
];

impl Default for CompressionConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            algorithms: vec![Coding::Zstd, Coding::Brotli, Coding::Gzip],
            gzip_level: 1,
            brotli_level: 4,
            zstd_level: 3,
            min_length: 256,
            types: DEFAULT_TYPES.iter().map(|t| (*t).to_string()).collect(),
        }
    }
}

/// The table form's keys.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Table {
    #[serde(default)]
    algorithms: Option<Vec<Coding>>,
    #[serde(default)]
    gzip_level: Option<u32>,
    #[serde(default)]
    brotli_level: Option<u32>,
    #[serde(default)]
    zstd_level: Option<i32>,
    #[serde(default)]
    min_length: Option<u64>,
    #[serde(default)]
    types: Option<Vec<String>>,
}

impl<'de> Deserialize<'de> for CompressionConfig {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Setting;
        impl<'de> serde::de::Visitor<'de> for Setting {
            type Value = CompressionConfig;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("true, false, or a table { algorithms, gzip_level, brotli_level, zstd_level, min_length, types }")
            }
            fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<CompressionConfig, E> {
                Ok(CompressionConfig {
                    enabled: v,
                    ..CompressionConfig::default()
                })
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                map: A,
            ) -> Result<CompressionConfig, A::Error> {
                let t = Table::deserialize(serde::de::value::MapAccessDeserializer::new(map))?;
                let d = CompressionConfig::default();
                Ok(CompressionConfig {
                    enabled: true,
                    algorithms: t.algorithms.unwrap_or(d.algorithms),
                    gzip_level: t.gzip_level.unwrap_or(d.gzip_level),
                    brotli_level: t.brotli_level.unwrap_or(d.brotli_level),
                    zstd_level: t.zstd_level.unwrap_or(d.zstd_level),
                    min_length: t.min_length.unwrap_or(d.min_length),
                    types: t.types.unwrap_or(d.types),
                })
            }
        }
        d.deserialize_any(Setting)
    }
}

impl CompressionConfig {
    /// Checks the levels and lists; paths are relative to the route or cluster.
    pub fn validate(&self) -> Result<(), InvalidField> {
        let at = |sub: &'static str| FieldPath::key("compression").then(sub);
        if !self.enabled {
            return Ok(());
        }
        if self.algorithms.is_empty() {
            return Err(InvalidField::new(
                at("algorithms"),
                Problem::Invalid(
                    "name at least one of \"zstd\", \"br\", \"gzip\" (or set `compression = false`)"
                        .into(),
                ),
            ));
        }
        if !(1..=9).contains(&self.gzip_level) {
            return Err(InvalidField::new(
                at("gzip_level"),
                Problem::out_of_range("within 1..=9", self.gzip_level),
            ));
        }
        if self.brotli_level > 11 {
            return Err(InvalidField::new(
                at("brotli_level"),
                Problem::out_of_range("within 0..=11", self.brotli_level),
            ));
        }
        if !(1..=19).contains(&self.zstd_level) {
            return Err(InvalidField::new(
                at("zstd_level"),
                Problem::out_of_range("within 1..=19", self.zstd_level),
            ));
        }
        for t in &self.types {
            let ok = t == "*"
                || t.split_once('/').is_some_and(|(a, b)| {
                    let token = |s: &str| {
                        !s.is_empty()
                            && s.bytes()
                                .all(|c| c.is_ascii_alphanumeric() || b"!#$&-^_.+*".contains(&c))
                    };
                    token(a) && token(b) && (!b.contains('*') || b == "*") && !a.contains('*')
                });
            if !ok {
                return Err(InvalidField::new(
                    at("types"),
                    Problem::Invalid(format!(
                        "`{t}` is not a media type; write e.g. \"text/html\", \"text/*\" or \"*\""
                    )),
                ));
            }
        }
        Ok(())
    }
}
