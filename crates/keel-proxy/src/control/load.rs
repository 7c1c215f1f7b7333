//! Loading a configuration: the config room parses and validates it without I/O, then the
//! components that will use the files it names check them (`tls::check_*` loads certificates
//! and keys, `discovery::check` reads a file source), and the error is placed at its key's
//! line as the config room places its own.

use std::path::Path;

use keel_balance::{FieldPath, InvalidField};

use crate::config::{ConfigError, ProxyConfig};

impl ProxyConfig {
    /// Parses and validates TOML, then checks the files it names; `origin` (a file name)
    /// appears in error messages. Relative TLS and access-log paths are taken from the
    /// current directory.
    pub fn from_toml_str(text: &str, origin: &str) -> Result<ProxyConfig, ConfigError> {
        let (doc, config) = Self::parse(text, origin, None)?;
        config.check_files().map_err(|e| doc.error(&e))?;
        Ok(config)
    }

    /// Reads, parses and validates a file, then checks the files it names (relative paths
    /// are taken from the file's directory).
    pub fn from_file(path: &Path) -> Result<ProxyConfig, ConfigError> {
        let origin = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            origin: origin.clone(),
            line: None,
            column: None,
            key: None,
            message: format!("cannot read the file: {e}"),
        })?;
        let (doc, mut config) = Self::parse(&text, &origin, path.parent())?;
        config.check_files().map_err(|e| doc.error(&e))?;
        config.source = Some(path.to_path_buf());
        Ok(config)
    }

    /// The I/O checks of the files a configuration names: listeners' and clusters' TLS files
    /// load, file discovery sources hold valid endpoints. Nothing is resolved.
    pub fn check_files(&self) -> Result<(), InvalidField> {
        for (i, l) in self.listeners.iter().enumerate() {
            if let Some(t) = &l.tls {
                crate::tls::check_listener(t)
                    .map_err(|e| e.under(FieldPath::key("listener").at(i).then("tls")))?;
            }
        }
        for (i, c) in self.clusters.iter().enumerate() {
            let at = FieldPath::key("cluster").at(i);
            crate::tls::check_upstream(c).map_err(|e| e.under(at.clone()))?;
            if let Some(d) = &c.discovery {
                crate::control::discovery::check(d)
                    .map_err(|e| e.under(at.clone().then("discovery")))?;
            }
            let shared = c
                .protections
                .outlier_detection
                .as_ref()
                .is_some_and(|o| o.shared.is_some());
            if shared && !cfg!(feature = "etcd") {
                return Err(InvalidField::new(
                    at.then("outlier_detection").then("shared"),
                    keel_balance::Problem::NotApplicable(
                        "this keel was built without etcd (cargo feature `etcd`)".into(),
                    ),
                ));
            }
        }
        Ok(())
    }
}
