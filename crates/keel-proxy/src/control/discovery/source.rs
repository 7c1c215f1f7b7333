//! What every discovery source is to the task that follows it.

use std::time::Duration;

use keel_balance::EndpointSpec;

use crate::control::discovery::error::DiscoveryError;

/// A place a cluster's endpoints are found in. The task that follows a source asks it every
/// [`Source::every`]; a new set is applied, a failure keeps the last one.
pub(crate) trait Source {
    /// Time between two looks.
    fn every(&self) -> Duration;
    /// The endpoints now; `None` when the source knows they have not changed since the last
    /// look that succeeded (`last_failed`: the last look failed, so look again in any case).
    async fn look(
        &mut self,
        last_failed: bool,
    ) -> Option<Result<Vec<EndpointSpec>, DiscoveryError>>;
}
