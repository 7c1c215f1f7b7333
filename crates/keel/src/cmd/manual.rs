//! `keel completions SHELL` and `keel man`: shell completions and manual pages, generated from
//! the same clap definitions that parse the command line, so they cannot drift from it.

use std::io::Write;
use std::path::PathBuf;

/// Arguments of `keel completions`.
#[derive(clap::Args)]
pub struct CompletionsArgs {
    /// The shell: bash, zsh, fish, elvish or powershell.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

/// Arguments of `keel man`.
#[derive(clap::Args)]
pub struct ManArgs {
    /// Print this subcommand's page (`keel-proxy(1)` for `proxy`) instead of keel(1).
    #[arg(value_name = "SUBCOMMAND")]
    pub subcommand: Option<String>,
    /// Write every page (keel.1 and keel-SUBCOMMAND.1) into this directory instead of printing
    /// one, for `/usr/share/man/man1` or a package.
    #[arg(long, value_name = "DIR", conflicts_with = "subcommand")]
    pub out: Option<PathBuf>,
}

/// Prints the completion script for `args.shell` on stdout.
pub fn completions(args: CompletionsArgs, mut cli: clap::Command) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    clap_complete::generate(args.shell, &mut cli, "keel", &mut out);
    out.flush()?;
    Ok(())
}

/// Prints a manual page (roff) on stdout, or writes them all into `--out`.
pub fn man(args: ManArgs, cli: clap::Command) -> anyhow::Result<()> {
    // Without the `help` subcommand, as clap_mangen leaves it out of the directory too; built,
    // so that a subcommand's page is titled `keel-proxy`, not `proxy`.
    let mut cli = cli.disable_help_subcommand(true);
    cli.build();
    if let Some(dir) = args.out {
        std::fs::create_dir_all(&dir)
            .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", dir.display()))?;
        clap_mangen::generate_to(cli, &dir)
            .map_err(|e| anyhow::anyhow!("cannot write the pages into {}: {e}", dir.display()))?;
        return Ok(());
    }
    let page = match args.subcommand {
        None => cli,
        Some(name) => match cli.find_subcommand(&name) {
            Some(sub) => sub.clone(),
            None => {
                let names: Vec<&str> = cli.get_subcommands().map(|s| s.get_name()).collect();
                return super::usage(format!(
                    "no subcommand {name:?}; allowed: {}",
                    names.join(", ")
                ));
            }
        },
    };
    let mut out = std::io::stdout().lock();
    clap_mangen::Man::new(page).render(&mut out)?;
    out.flush()?;
    Ok(())
}
