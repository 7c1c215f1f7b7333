//! `keel backend` (placeholder until its issue lands).

/// Arguments of `keel backend`.
#[derive(clap::Args)]
pub struct Args {}

/// Runs `keel backend`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`keel backend` is not built yet")
}
