//! Groups of a flat TOML table's keys: a table such as `[[cluster]]` keeps its keys side by
//! side in the file, while its type holds them in groups (`balance`, `timeouts`, ...). A
//! hand-written `Deserialize` of the table reads each key with [`KeySeed`] (which refuses an
//! unknown key at the key itself) and hands the value to the group that owns it
//! (`take`), so that a value's error keeps its key and line; `#[serde(flatten)]` would lose
//! both, and ignore unknown keys.

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, Visitor};

/// Reads a table's key: one of `keys`, or serde's "unknown field" error listing them.
pub(crate) struct KeySeed(pub &'static [&'static str]);

impl<'de> DeserializeSeed<'de> for KeySeed {
    type Value = &'static str;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<&'static str, D::Error> {
        d.deserialize_identifier(self)
    }
}

impl<'de> Visitor<'de> for KeySeed {
    type Value = &'static str;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("field identifier")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<&'static str, E> {
        self.0
            .iter()
            .find(|k| **k == v)
            .copied()
            .ok_or_else(|| E::unknown_field(v, self.0))
    }
}

/// The keys already read in a table, for serde's "duplicate field" error.
#[derive(Default)]
pub(crate) struct Seen(Vec<&'static str>);

impl Seen {
    /// Records `key`; a second time, the "duplicate field" error.
    pub fn first<E: de::Error>(&mut self, key: &'static str) -> Result<(), E> {
        if self.0.contains(&key) {
            return Err(E::duplicate_field(key));
        }
        self.0.push(key);
        Ok(())
    }
}

/// Declares a group of a flat table's keys: the struct (its fields named as the keys unless
/// `key => field` renames one), its `Default` (each field's `= default`), `KEYS` (the TOML keys,
/// in order) and `take`, which reads the value of one of its keys from a map (through
/// `with path`, a `deserialize_with` function, when given) and says whether the key was its.
macro_rules! group {
    (
        $(#[$sm:meta])*
        pub struct $name:ident {
            $(
                $(#[$fm:meta])*
                $key:literal => $field:ident: $ty:ty = $default:expr $(, with $with:path)?;
            )*
        }
    ) => {
        $(#[$sm])*
        #[derive(Debug, Clone, PartialEq)]
        pub struct $name {
            $(
                $(#[$fm])*
                pub $field: $ty,
            )*
        }

        impl Default for $name {
            fn default() -> Self {
                Self {
                    $($field: $default,)*
                }
            }
        }

        impl $name {
            /// The TOML keys of this group, in order.
            pub const KEYS: &'static [&'static str] = &[$($key),*];

            /// Reads the value of `key` from `map` if the key is one of this group's; `false`
            /// (nothing read) otherwise.
            pub(crate) fn take<'de, A: serde::de::MapAccess<'de>>(
                &mut self,
                key: &str,
                map: &mut A,
            ) -> Result<bool, A::Error> {
                match key {
                    $($key => self.$field = $crate::config::group::group!(@value map, $ty $(, $with)?),)*
                    _ => return Ok(false),
                }
                Ok(true)
            }
        }
    };
    (@value $map:ident, $ty:ty) => {
        $map.next_value::<$ty>()?
    };
    (@value $map:ident, $ty:ty, $with:path) => {{
        struct With;
        impl<'de> serde::de::DeserializeSeed<'de> for With {
            type Value = $ty;
            fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<$ty, D::Error> {
                $with(d)
            }
        }
        $map.next_value_seed(With)?
    }};
}
pub(crate) use group;
