//! `keel distribute` (placeholder until its issue lands).

/// Arguments of `keel distribute`.
#[derive(clap::Args)]
pub struct Args {}

/// Runs `keel distribute`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`keel distribute` is not built yet")
}
