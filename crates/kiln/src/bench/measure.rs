//! Runs one benchmark row in a child process and reads the child's peak resident memory from the
//! kernel (`wait4`'s rusage), so kiln's and PyTorch's rows are measured the same way.

use std::io::Read;
use std::process::{Command, Stdio};

/// What a row's process printed, and the most memory it held.
#[derive(Debug, Clone)]
pub struct Measured {
    pub stdout: String,
    pub stderr: String,
    pub success: bool,
    /// How it ended (exit code or signal).
    pub status: std::process::ExitStatus,
    /// Peak resident set size in MiB.
    pub peak_rss_mib: f64,
}

/// Runs `cmd` to completion with its output captured.
pub fn run_measured(cmd: &mut Command) -> std::io::Result<Measured> {
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn()?;
    let mut out = child.stdout.take().expect("piped");
    let mut err = child.stderr.take().expect("piped");
    // Drain stderr on a thread so neither pipe can fill and block the child.
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let mut stdout = String::new();
    out.read_to_string(&mut stdout)?;
    let stderr = err_reader.join().unwrap_or_default();
    let (status, usage) = wait4(child.id())?;
    Ok(Measured {
        stdout,
        stderr,
        success: libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        status: std::os::unix::process::ExitStatusExt::from_raw(status),
        // Linux reports ru_maxrss in KiB.
        peak_rss_mib: usage.ru_maxrss as f64 / 1024.0,
    })
}

/// Reaps `pid` and returns its wait status and resource usage. `std::process::Child::wait` drops
/// the rusage, so the child is reaped here instead (std never waits on it afterwards).
fn wait4(pid: u32) -> std::io::Result<(i32, libc::rusage)> {
    let mut status = 0;
    // SAFETY: rusage is plain data; wait4 fills it for our own child.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        let r = unsafe { libc::wait4(pid as libc::pid_t, &mut status, 0, &mut usage) };
        if r >= 0 {
            return Ok((status, usage));
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}
