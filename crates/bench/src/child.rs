//! One benchmark child process: spawned (optionally inside a memory
//! cgroup), waited for with a deadline, reaped with `wait4` so its peak
//! resident set (VmHWM, `ru_maxrss`) and block input come back with its
//! exit status.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::Serialize;

/// How the child ended.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Exit {
    Code(i32),
    Signal(i32),
    /// Killed by the harness at the deadline.
    TimedOut,
}

/// What the kernel reports about a finished child.
#[derive(Clone, Debug, Serialize)]
pub struct ChildOutcome {
    pub exit: Exit,
    pub wall_s: f64,
    /// Peak resident set (VmHWM) in bytes.
    pub max_rss_bytes: u64,
    /// Bytes the child read from storage (`ru_inblock` x 512).
    pub disk_read_bytes: u64,
    pub user_s: f64,
    pub sys_s: f64,
}

/// Runs `cmd` with stdout and stderr sent to files, inside the cgroup whose
/// `cgroup.procs` descriptor is `cgroup_procs` when given, killing it with
/// SIGKILL after `timeout`.
pub fn run(
    cmd: &mut Command,
    stdout: &Path,
    stderr: &Path,
    cgroup_procs: Option<std::os::fd::RawFd>,
    timeout: Option<Duration>,
) -> Result<ChildOutcome> {
    let out =
        std::fs::File::create(stdout).with_context(|| format!("creating {}", stdout.display()))?;
    let err =
        std::fs::File::create(stderr).with_context(|| format!("creating {}", stderr.display()))?;
    cmd.stdin(Stdio::null()).stdout(out).stderr(err);
    if let Some(fd) = cgroup_procs {
        // SAFETY: the hook runs in the forked child before exec, where only
        // async-signal-safe calls are allowed: getpid and write on an
        // already-open descriptor, with the pid formatted into a stack buffer
        // (no allocation, no locks). Writing the pid to `cgroup.procs` moves
        // the child into the cgroup, so everything it maps or reads after
        // exec is charged there.
        unsafe {
            cmd.pre_exec(move || {
                let pid = libc::getpid();
                let mut buf = [0u8; 24];
                let mut n = buf.len();
                let mut v = pid as u64;
                buf[n - 1] = b'\n';
                n -= 1;
                loop {
                    n -= 1;
                    buf[n] = b'0' + (v % 10) as u8;
                    v /= 10;
                    if v == 0 {
                        break;
                    }
                }
                let bytes = &buf[n..];
                let w = libc::write(fd, bytes.as_ptr() as *const libc::c_void, bytes.len());
                if w != bytes.len() as isize {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let start = Instant::now();
    let child = cmd.spawn().with_context(|| {
        format!(
            "starting {}{}",
            cmd.get_program().to_string_lossy(),
            if cgroup_procs.is_some() {
                " inside the memory cgroup"
            } else {
                ""
            }
        )
    })?;
    let pid = child.id() as libc::pid_t;
    let mut status: libc::c_int = 0;
    // SAFETY: rusage is plain old data; zeroed is a valid value.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let mut timed_out = false;
    loop {
        // SAFETY: `pid` is our own unreaped child (std's `Child` is never
        // waited on, so nothing else reaps it); status and usage point to
        // live locals.
        let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
        if r == pid {
            break;
        }
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e).context("waiting for the benchmark child");
        }
        if let Some(t) = timeout {
            if !timed_out && start.elapsed() >= t {
                // SAFETY: signalling our own unreaped child; its pid cannot
                // have been reused before we reap it.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                timed_out = true;
            }
        }
        std::thread::sleep(Duration::from_millis(if timed_out { 1 } else { 10 }));
    }
    let wall_s = start.elapsed().as_secs_f64();
    drop(child);
    let exit = if timed_out {
        Exit::TimedOut
    } else if libc::WIFEXITED(status) {
        Exit::Code(libc::WEXITSTATUS(status))
    } else if libc::WIFSIGNALED(status) {
        Exit::Signal(libc::WTERMSIG(status))
    } else {
        Exit::Code(-1)
    };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    Ok(ChildOutcome {
        exit,
        wall_s,
        max_rss_bytes: (usage.ru_maxrss.max(0) as u64) * 1024,
        disk_read_bytes: (usage.ru_inblock.max(0) as u64) * 512,
        user_s: tv(usage.ru_utime),
        sys_s: tv(usage.ru_stime),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_timeout_and_rss() {
        let dir = tempfile::tempdir().unwrap();
        let (o, e) = (dir.path().join("o"), dir.path().join("e"));
        let r = run(
            Command::new("sh").args(["-c", "echo hi; exit 3"]),
            &o,
            &e,
            None,
            None,
        )
        .unwrap();
        assert_eq!(r.exit, Exit::Code(3));
        assert_eq!(std::fs::read_to_string(&o).unwrap(), "hi\n");
        assert!(r.max_rss_bytes > 0);
        let r = run(
            Command::new("sleep").arg("5"),
            &o,
            &e,
            None,
            Some(Duration::from_millis(50)),
        )
        .unwrap();
        assert_eq!(r.exit, Exit::TimedOut);
        assert!(r.wall_s < 4.0, "{r:?}");
        assert!(run(&mut Command::new("/nonexistent/bin"), &o, &e, None, None).is_err());
    }
}
