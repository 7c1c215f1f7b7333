//! Binary upgrade without refusing a connection (SIGUSR2), as NGINX's USR2 and HAProxy's `-x`
//! do it: the running process starts the binary at its own path again (the new one, once the
//! file was replaced) with the same arguments and hands it its listening sockets. The sockets
//! are never closed: connections that arrive while both run wait in the same accept queue and
//! either process takes them. When the new process says it is serving, the old one drains as
//! on SIGTERM and exits; if the new one fails to start, the old one keeps serving.
//!
//! The hand-over: the sockets stay open across `exec` (close-on-exec cleared in the child
//! only), `KEEL_INHERIT_FDS=ADDR=FD,...` names them by the address each was configured with,
//! and `KEEL_UPGRADE_READY_FD=FD` is a pipe on which the new process writes one line once its
//! listeners accept.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::time::Duration;

const INHERIT_FDS: &str = "KEEL_INHERIT_FDS";
const READY_FD: &str = "KEEL_UPGRADE_READY_FD";

/// How long the old process waits for the new one to serve before it gives up on the upgrade.
const READY_WAIT: Duration = Duration::from_secs(60);

/// The sockets handed over by the process this one replaces (none when started by hand).
pub fn inherited() -> anyhow::Result<Vec<(SocketAddr, std::net::TcpListener)>> {
    let Some(spec) = std::env::var_os(INHERIT_FDS) else {
        return Ok(Vec::new());
    };
    // Not passed on to anything this process starts.
    std::env::remove_var(INHERIT_FDS);
    let spec = spec.to_string_lossy().into_owned();
    let mut out = Vec::new();
    for item in spec.split(',').filter(|s| !s.is_empty()) {
        let (addr, fd) = item
            .rsplit_once('=')
            .ok_or_else(|| anyhow::anyhow!("{INHERIT_FDS}: `{item}` is not ADDR=FD"))?;
        let addr: SocketAddr = addr
            .parse()
            .map_err(|e| anyhow::anyhow!("{INHERIT_FDS}: `{addr}`: {e}"))?;
        let fd: RawFd = fd
            .parse()
            .map_err(|e| anyhow::anyhow!("{INHERIT_FDS}: `{fd}`: {e}"))?;
        // SAFETY: the parent process opened this descriptor for us and handed it over; nothing
        // else in this process owns it.
        let listener = unsafe { std::net::TcpListener::from_raw_fd(fd) };
        set_cloexec(fd, true)?;
        out.push((addr, listener));
    }
    Ok(out)
}

/// Tells the process this one replaces that it serves (a no-op when started by hand).
pub fn signal_ready() {
    let Some(fd) = std::env::var_os(READY_FD) else {
        return;
    };
    std::env::remove_var(READY_FD);
    let Ok(fd) = fd.to_string_lossy().parse::<RawFd>() else {
        return;
    };
    // SAFETY: the write end of the parent's pipe, handed to this process only.
    let mut pipe = unsafe { std::fs::File::from_raw_fd(fd) };
    let _ = writeln!(pipe, "ready {}", std::process::id());
}

fn set_cloexec(fd: RawFd, on: bool) -> std::io::Result<()> {
    // SAFETY: fcntl on a descriptor this process holds; no memory is passed.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFD);
        if flags < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let flags = if on {
            flags | libc::FD_CLOEXEC
        } else {
            flags & !libc::FD_CLOEXEC
        };
        if libc::fcntl(fd, libc::F_SETFD, flags) < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// A new process started from `exe` with this process's arguments, holding `sockets`; returns
/// its PID once it serves, or why the upgrade did not happen (the new process was stopped then).
pub async fn start_successor(
    exe: PathBuf,
    sockets: Vec<(SocketAddr, RawFd)>,
) -> anyhow::Result<u32> {
    let (read, write) = pipe()?;
    let spec = sockets
        .iter()
        .map(|(a, fd)| format!("{a}={fd}"))
        .collect::<Vec<_>>()
        .join(",");
    let mut keep: Vec<RawFd> = sockets.iter().map(|(_, fd)| *fd).collect();
    keep.push(write.as_raw_fd());
    let mut cmd = std::process::Command::new(&exe);
    cmd.args(std::env::args_os().skip(1))
        .env(INHERIT_FDS, spec)
        .env(READY_FD, write.as_raw_fd().to_string());
    // SAFETY: between fork and exec only fcntl, which is async-signal-safe, is called.
    unsafe {
        cmd.pre_exec(move || {
            for &fd in &keep {
                set_cloexec(fd, false)?;
            }
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| anyhow::anyhow!("cannot start {}: {e}", exe.display()))?;
    drop(write);
    let pid = child.id();
    let waited = tokio::task::spawn_blocking(move || {
        let mut pipe = std::fs::File::from(read);
        let mut line = String::new();
        // Ends with the line, or empty when the new process exited without writing it.
        let _ = pipe.read_to_string(&mut line);
        line
    });
    let line = match tokio::time::timeout(READY_WAIT, waited).await {
        Ok(Ok(line)) => line,
        _ => String::new(),
    };
    if line.starts_with("ready") {
        // Not waited for: it outlives this process (and is then reaped by init).
        drop(child);
        return Ok(pid);
    }
    let _ = child.kill();
    let status = child.wait();
    anyhow::bail!(
        "the new process (PID {pid}) did not start serving ({}); this one keeps serving",
        match status {
            Ok(s) => s.to_string(),
            Err(e) => e.to_string(),
        }
    )
}

fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: pipe2 writes two descriptors into the array it is given.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just created and are owned here only.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}
