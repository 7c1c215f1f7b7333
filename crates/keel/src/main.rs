//! `keel`: one binary, one subcommand per job.

mod cmd;
mod lab;
mod logging;
mod usage;

use clap::{CommandFactory, Parser, Subcommand};

/// mimalloc instead of the system allocator: the proxy's profile spent 13-15 % of its user time
/// in glibc malloc/free (BENCHMARKS.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

// mimalloc's own entry point, in the library the `mimalloc` crate links (libmimalloc-sys
// declares it only under its `extended` feature, which would add a dependency).
extern "C" {
    fn mi_collect(force: bool);
}

/// The proxy's collection hook (`keel_proxy::StartOptions::collect`), called once a second on
/// each serving thread. mimalloc v3 gives freed pages back (purges them) only when the
/// allocator runs again, 1 s after the free: a thread whose connections all went quiet would
/// keep them. `mi_collect(false)` frees this thread's empty pages and purges the expired ones,
/// as an allocation would; `true` would also purge unexpired ones and walk the full pages.
pub(crate) fn collect_allocator() {
    // SAFETY: no arguments to uphold; mimalloc collects the calling thread's heap.
    unsafe { mi_collect(false) }
}

/// keel: a load balancer that can prove how reliable its choices are.
#[derive(Parser)]
#[command(name = "keel", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The main job: the reliability experiments as formula, simulation and real traffic, with a report.
    Lab(cmd::lab::Args),
    /// Preview how a strategy spreads picks or keys over endpoints, and what an add/remove moves.
    Distribute(cmd::distribute::Args),
    /// The closed forms: success rate of each strategy when some servers fail (and --sweep charts).
    Analyze(cmd::analyze::Args),
    /// Discrete-event simulation of the reliability experiments (E1-E6) or a scenario file.
    Simulate(cmd::simulate::Args),
    /// Fit a model of a cluster from the proxy's access log, simulate every strategy on it, rank them.
    Advise(cmd::advise::Args),
    /// Run the HTTP reverse proxy from a TOML configuration file.
    Proxy(cmd::proxy::Args),
    /// A small HTTP server for experiments, demos and tests, with injectable faults.
    Backend(cmd::backend::Args),
    /// Print the shell completion script for bash, zsh, fish, elvish or powershell.
    Completions(cmd::manual::CompletionsArgs),
    /// Print keel's manual page (roff), or a subcommand's, or write them all with --out DIR.
    Man(cmd::manual::ManArgs),
    /// Register an endpoint in etcd under a lease kept alive until SIGTERM/SIGINT (then deleted).
    #[cfg(feature = "etcd")]
    Register(cmd::register::Args),
}

/// Transparent huge pages off for the proxy. mimalloc v3 asks for them on its arenas
/// (`MADV_HUGEPAGE`, its `allow_thp` option), so with the kernel's `madvise` setting every
/// 2 MB of heap a thread touched became resident at once: the empty proxy held 11.4 MB of
/// anonymous memory, 2.0 MB without them (BENCHMARKS.md, memory per connection). Turned off
/// before anything runs ([`THP_OFF_FIRST`]), mimalloc's set-up included, so that no page is
/// faulted in huge; the other subcommands (the lab, simulations: no memory to save, CPU to
/// spend) get them back once the command line is read. `MIMALLOC_ALLOW_THP` in the
/// environment leaves it to mimalloc.
#[cfg_attr(not(target_os = "linux"), allow(unused_variables))]
fn thp_off(off: bool) {
    // SAFETY: getenv reads the environment, which nothing writes yet (no thread is started);
    // prctl takes a flag.
    #[cfg(target_os = "linux")]
    unsafe {
        if libc::getenv(c"MIMALLOC_ALLOW_THP".as_ptr()).is_null() {
            libc::prctl(libc::PR_SET_THP_DISABLE, libc::c_ulong::from(off), 0, 0, 0);
        }
    }
}

/// Run by the dynamic loader before every constructor (`.preinit_array`): mimalloc's own and
/// the allocations made before `main` faulted two huge pages (4 MB) when this ran in `main`.
#[cfg(target_os = "linux")]
#[used]
#[link_section = ".preinit_array"]
static THP_OFF_FIRST: extern "C" fn() = {
    extern "C" fn first() {
        thp_off(true);
    }
    first
};

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    if !matches!(cli.command, Command::Proxy(_)) {
        thp_off(false);
    }
    // The proxy logs what it does (`--log`, default info; `--log-format`); the other
    // subcommands print their results and log only their own warnings, as text: the proxies the
    // lab runs in-process answer 504s and 503s on purpose, so theirs are errors only.
    let (format, filter) = match &cli.command {
        Command::Proxy(args) => (args.log_format, args.log.as_str()),
        #[cfg(feature = "etcd")]
        Command::Register(args) => (logging::LogFormat::Text, args.log.as_str()),
        _ => (logging::LogFormat::Text, "keel=warn,keel_proxy=error"),
    };
    if let Err(e) = logging::init(format, filter) {
        return cmd::exit(Err(e));
    }
    let result = match cli.command {
        Command::Lab(args) => cmd::lab::run(args),
        Command::Distribute(args) => cmd::distribute::run(args),
        Command::Analyze(args) => cmd::analyze::run(args),
        Command::Simulate(args) => cmd::simulate::run(args),
        Command::Advise(args) => cmd::advise::run(args),
        Command::Proxy(args) => cmd::proxy::run(args),
        Command::Backend(args) => cmd::backend::run(args),
        Command::Completions(args) => cmd::manual::completions(args, Cli::command()),
        Command::Man(args) => cmd::manual::man(args, Cli::command()),
        #[cfg(feature = "etcd")]
        Command::Register(args) => cmd::register::run(args),
    };
    cmd::exit(result)
}
