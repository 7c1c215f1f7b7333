//! Durations in configuration files: humantime text (`"250ms"`, `"5s"`), at most
//! [`MAX_DURATION`].
//!
//! Why a bound: a configured duration is added to clock readings and multiplied (ejection
//! times); `"300000000000y"` parses, and would later overflow `Instant + Duration` and panic in
//! the middle of serving. A year is far beyond any sensible timeout or interval.

use std::time::Duration;

use serde::{Deserialize, Deserializer, Serializer};

/// The longest duration a configuration may hold: 365 days.
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

fn check<E: serde::de::Error>(d: Duration) -> Result<Duration, E> {
    if d > MAX_DURATION {
        return Err(E::custom(format!(
            "duration {} is too long: at most 365d",
            humantime::format_duration(d)
        )));
    }
    Ok(d)
}

/// Deserializes a humantime duration of at most [`MAX_DURATION`].
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    check(humantime_serde::deserialize(d)?)
}

/// Serializes as humantime text.
pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    humantime_serde::serialize(d, s)
}

/// The same for `Option<Duration>`.
pub mod option {
    use super::*;

    /// Deserializes an optional humantime duration of at most [`MAX_DURATION`].
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        let v: Option<humantime_serde::Serde<Duration>> = Option::deserialize(d)?;
        v.map(|v| check(v.into_inner())).transpose()
    }

    /// Serializes as humantime text.
    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        humantime_serde::option::serialize(d, s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize, Debug)]
    struct T {
        #[serde(with = "super")]
        d: Duration,
        #[serde(default, with = "super::option")]
        o: Option<Duration>,
    }

    #[test]
    fn bounded() {
        let t: T = toml::from_str("d = \"365d\"\no = \"5s\"").unwrap();
        assert_eq!((t.d, t.o), (MAX_DURATION, Some(Duration::from_secs(5))));
        let e = toml::from_str::<T>("d = \"366d\"").unwrap_err();
        assert!(e.to_string().contains("at most 365d"), "{e}");
        let e = toml::from_str::<T>("d = \"1s\"\no = \"300000000000y\"").unwrap_err();
        assert!(e.to_string().contains("at most 365d"), "{e}");
    }
}
