//! Writing an output without losing what was there.
//!
//! Every writer of a model file or directory follows the same steps:
//! 1. [`check_disjoint`]: the output is not the input, inside it, or above it.
//! 2. The caller decides whether what is at the target may be replaced (only
//!    it knows what its own outputs look like).
//! 3. [`clean_stale_temps`]: leftovers of writers of the same target that
//!    died (kill -9, power loss) are removed, or put back when an interrupted
//!    replace left the old output beside an empty target.
//! 4. Everything is written to [`temp_path`] beside the target.
//! 5. [`replace`]: the finished temp takes the target's place. An existing
//!    target is exchanged atomically (`renameat2(RENAME_EXCHANGE)`), so the
//!    old or the new output is at the target at every instant.

use std::ffi::OsStr;
use std::fs;
use std::io;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Infix of temp names: `.NAME.tmp-PID[-SEQ]` (and the same with `.old`).
const TMP_INFIX: &str = ".tmp-";
/// Suffix of an old output moved aside by the non-atomic fallback of [`replace`].
const OLD_SUFFIX: &str = ".old";

fn parent_of(target: &Path) -> PathBuf {
    match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

fn file_name_of(target: &Path) -> io::Result<String> {
    target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{}: the output path has no file name", target.display()),
            )
        })
}

/// Writers started in this process, so two writers of one target in one
/// process never share a temp path.
static WRITERS: AtomicU64 = AtomicU64::new(0);

/// A fresh hidden path beside `target` for one writer of this process:
/// `DIR/.NAME.tmp-PID-SEQ`.
pub fn temp_path(target: &Path) -> io::Result<PathBuf> {
    let name = file_name_of(target)?;
    let seq = WRITERS.fetch_add(1, Ordering::Relaxed);
    Ok(parent_of(target).join(format!(".{name}{TMP_INFIX}{}-{seq}", std::process::id())))
}

/// A leftover beside a target: a temp (`.NAME.tmp-PID`) or an old output
/// moved aside (`.NAME.tmp-PID.old`, or `.NAME.old` from older versions).
#[derive(Debug, PartialEq, Eq)]
struct Leftover {
    /// `None` for the pid-less legacy `.NAME.old`.
    pid: Option<u32>,
    old: bool,
}

fn parse_leftover(entry: &OsStr, target_name: &str) -> Option<Leftover> {
    let entry = entry.to_str()?;
    let rest = entry.strip_prefix('.')?.strip_prefix(target_name)?;
    if rest == OLD_SUFFIX {
        return Some(Leftover {
            pid: None,
            old: true,
        });
    }
    let rest = rest.strip_prefix(TMP_INFIX)?;
    let (id, old) = match rest.strip_suffix(OLD_SUFFIX) {
        Some(d) => (d, true),
        None => (rest, false),
    };
    let is_number = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let digits = match id.split_once('-') {
        Some((pid, seq)) if is_number(seq) => pid,
        Some(_) => return None,
        None => id,
    };
    if !is_number(digits) {
        return None;
    }
    Some(Leftover {
        pid: Some(digits.parse().ok()?),
        old,
    })
}

/// Whether process `pid` exists (ours or another user's).
fn process_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    // SAFETY: kill with signal 0 sends nothing; it only asks the kernel
    // whether the pid exists and may be signalled. No memory is involved.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// What [`clean_stale_temps`] did, one line per leftover, for the user.
pub type CleanReport = Vec<String>;

/// Removes what dead writers of `target` left beside it, and puts an old
/// output back at `target` when an interrupted replace left the target
/// empty. `is_ours(path)` must say whether a leftover holds only what the
/// writer writes; anything else is left alone and reported.
///
/// Leftovers of live processes (another writer of the same target running
/// now) are never touched.
pub fn clean_stale_temps(
    target: &Path,
    is_ours: &dyn Fn(&Path) -> bool,
) -> io::Result<CleanReport> {
    let name = file_name_of(target)?;
    let dir = parent_of(target);
    let mut report = Vec::new();
    let entries = match fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(report),
        Err(e) => return Err(e),
    };
    let mut found: Vec<(PathBuf, Leftover)> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| parse_leftover(&e.file_name(), &name).map(|l| (e.path(), l)))
        .filter(|(_, l)| l.pid.is_none_or(|p| !process_alive(p)))
        .collect();
    // Old outputs first: one of them may go back to the target.
    found.sort_by_key(|(_, l)| !l.old);
    for (path, leftover) in found {
        if !is_ours(&path) {
            report.push(format!(
                "left {} alone: it does not look like a leftover of this writer",
                path.display()
            ));
            continue;
        }
        if leftover.old && fs::symlink_metadata(target).is_err() {
            fs::rename(&path, target)?;
            report.push(format!(
                "an interrupted replace had left {} empty: put the previous output back from {}",
                target.display(),
                path.display()
            ));
            continue;
        }
        remove_any(&path)?;
        report.push(format!(
            "removed {}, left by a writer that died",
            path.display()
        ));
    }
    Ok(report)
}

/// Removes a file or a directory tree.
fn remove_any(path: &Path) -> io::Result<()> {
    let meta = fs::symlink_metadata(path)?;
    if meta.is_dir() {
        fs::remove_dir_all(path)
    } else {
        fs::remove_file(path)
    }
}

/// Moves the finished `tmp` into `target`'s place and syncs the directory.
/// An existing target (which the caller has checked may be replaced) is
/// exchanged with `tmp` in one step and then removed, so a crash at any
/// point leaves the old or the new output at `target`, and at worst a
/// leftover that [`clean_stale_temps`] handles.
pub fn replace(tmp: &Path, target: &Path) -> io::Result<()> {
    if fs::symlink_metadata(target).is_err() {
        rename_no_replace(tmp, target)?;
    } else {
        match exchange(tmp, target) {
            Ok(()) => remove_any(tmp)?,
            Err(e) if exchange_unsupported(&e) => {
                // Not atomic: the aside name is one clean_stale_temps
                // recovers from if we die between the two renames.
                let aside = PathBuf::from(format!("{}{OLD_SUFFIX}", tmp.display()));
                fs::rename(target, &aside)?;
                fs::rename(tmp, target)?;
                sync_dir(&parent_of(target))?;
                remove_any(&aside)?;
            }
            Err(e) => return Err(e),
        }
    }
    sync_dir(&parent_of(target))
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    fs::File::open(dir)?.sync_all()
}

fn exchange_unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINVAL) | Some(libc::ENOSYS) | Some(libc::EOPNOTSUPP)
    )
}

#[cfg(target_os = "linux")]
fn renameat2(from: &Path, to: &Path, flags: libc::c_uint) -> io::Result<()> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| {
        CString::new(p.as_os_str().as_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path holds a NUL byte"))
    };
    let (from_c, to_c) = (c(from)?, c(to)?);
    // SAFETY: both pointers are NUL-terminated strings that outlive the
    // call; AT_FDCWD resolves relative paths as rename(2) does.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            from_c.as_ptr(),
            libc::AT_FDCWD,
            to_c.as_ptr(),
            flags,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(target_os = "linux")]
fn exchange(a: &Path, b: &Path) -> io::Result<()> {
    renameat2(a, b, libc::RENAME_EXCHANGE)
}

#[cfg(not(target_os = "linux"))]
fn exchange(_: &Path, _: &Path) -> io::Result<()> {
    Err(io::Error::from_raw_os_error(libc::ENOSYS))
}

/// `rename` that fails rather than replace something that appeared at `to`.
fn rename_no_replace(from: &Path, to: &Path) -> io::Result<()> {
    #[cfg(target_os = "linux")]
    match renameat2(from, to, libc::RENAME_NOREPLACE) {
        Err(e) if exchange_unsupported(&e) => {}
        other => return other,
    }
    fs::rename(from, to)
}

/// `path` made absolute, component by component: symlinks resolved where
/// the path exists, `.` and `..` applied lexically past that.
fn resolve(path: &Path) -> io::Result<PathBuf> {
    let abs = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()?.join(path)
    };
    let mut out = PathBuf::from("/");
    for part in abs.components() {
        match part {
            Component::Normal(name) => {
                out.push(name);
                if let Ok(real) = out.canonicalize() {
                    out = real;
                }
            }
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir | Component::RootDir | Component::Prefix(_) => {}
        }
    }
    Ok(out)
}

/// Refuses an output that is the input, lies inside it, or contains it:
/// writing would destroy the data being read.
pub fn check_disjoint(input: &Path, output: &Path) -> Result<(), String> {
    let (inp, out) = match (resolve(input), resolve(output)) {
        (Ok(i), Ok(o)) => (i, o),
        (Err(e), _) => return Err(format!("{}: {e}", input.display())),
        (_, Err(e)) => return Err(format!("{}: {e}", output.display())),
    };
    let say = |how: &str| {
        Err(format!(
            "the output {} {how} the input {}: writing it would destroy the checkpoint being read; choose another --output",
            output.display(),
            input.display()
        ))
    };
    if out == inp {
        say("is")
    } else if out.starts_with(&inp) {
        say("lies inside")
    } else if inp.starts_with(&out) {
        say("contains")
    } else {
        Ok(())
    }
}

/// Whether a writer may replace something at its output path that is not
/// verifiably one of its own outputs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Overwrite {
    /// Replace only an output of the same kind, verified as such
    /// (`--output` without `--force`).
    #[default]
    VerifiedOnly,
    /// Also replace a damaged output of the same kind (`--force`). Never
    /// anything else: a directory with foreign files is refused regardless.
    Force,
}

#[cfg(test)]
mod tests;
