//! `keel proxy` (placeholder until its issue lands).

/// Arguments of `keel proxy`.
#[derive(clap::Args)]
pub struct Args {}

/// Runs `keel proxy`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`keel proxy` is not built yet")
}
