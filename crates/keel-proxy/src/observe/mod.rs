//! Watching each request: the one record of a request ([`record`]), the access log
//! ([`access_log`]) and the export of sampled requests' spans (`otlp`, cargo feature `otlp`). Counters and their Prometheus text are the ground floor's
//! (`crate::metrics`); the admin listener that shows them is the top floor's (`crate::admin`).

pub(crate) mod access_log;
#[cfg(feature = "otlp")]
pub(crate) mod otlp;
pub(crate) mod record;

use crate::config::TracingConfig;
use crate::exchange::trace::Tracing;
use crate::metrics::Registry;

/// The running proxy's `[tracing]`: the trace context, and the exporter of sampled requests'
/// spans when `otlp` names a collector (its counters are the registry's, kept across reloads).
pub(crate) fn tracing(config: &TracingConfig, registry: &Registry) -> anyhow::Result<Tracing> {
    #[allow(unused_mut)]
    let mut tracing = Tracing::new(config);
    #[cfg(feature = "otlp")]
    if let Some(url) = &config.otlp {
        tracing.export = Some(otlp::start(config, url, registry.trace_spans.clone())?);
    }
    #[cfg(not(feature = "otlp"))]
    let _ = registry;
    Ok(tracing)
}
