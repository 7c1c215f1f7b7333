//! `keel simulate` (placeholder until its issue lands).

/// Arguments of `keel simulate`.
#[derive(clap::Args)]
pub struct Args {}

/// Runs `keel simulate`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`keel simulate` is not built yet")
}
