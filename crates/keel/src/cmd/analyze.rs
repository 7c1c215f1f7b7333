//! `keel analyze` (placeholder until its issue lands).

/// Arguments of `keel analyze`.
#[derive(clap::Args)]
pub struct Args {}

/// Runs `keel analyze`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`keel analyze` is not built yet")
}
