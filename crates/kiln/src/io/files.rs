//! Durable file operations: what kiln writes is either there whole or not at all, even across a
//! crash or a full disk, and what kiln reads is a regular file, never a device that never ends.
//!
//! A write goes to a temporary file in the target's folder, is flushed to the disk (`fsync`), renamed
//! over the target, and the folder itself is flushed so the rename survives a power cut. A folder is
//! deleted by first renaming it out of the way (one atomic step), so a crash mid-delete never leaves a
//! half-deleted folder under its real name.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{KilnError, Result};

/// Prefix of the temporary files and folders kiln writes before renaming them into place.
pub const TEMP_PREFIX: &str = ".kiln-tmp-";
/// Prefix of folders renamed out of the way before deletion. Leftovers of both are removed at the
/// next start (see [`remove_leftovers`]).
pub const TRASH_PREFIX: &str = ".kiln-trash-";

/// Flushes a folder's entries (new names, renames) to the disk.
pub fn sync_dir(dir: &Path) -> Result<()> {
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(|e| KilnError::io(dir, e))
}

/// The temporary name [`atomic_write`] writes `path`'s bytes to before the rename.
pub fn temp_path(path: &Path) -> PathBuf {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("out");
    path.with_file_name(format!("{TEMP_PREFIX}{name}-{}", std::process::id()))
}

/// Writes `bytes` to `path` durably, without the rename: the caller renames (see
/// [`atomic_write`]). On failure nothing is left behind.
pub fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let result = File::create(path)
        .and_then(|mut f| f.write_all(bytes).and_then(|()| f.sync_all()))
        .map_err(|e| KilnError::io(path, e));
    if result.is_err() {
        let _ = std::fs::remove_file(path);
    }
    result
}

/// Writes `bytes` to `path` through a flushed temporary file and a rename, so a reader (or a crash,
/// or a full disk) never sees a half-written file: the old content stays until the new one is whole.
pub fn atomic_write(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| KilnError::io(dir, e))?;
    let tmp = temp_path(path);
    write_synced(&tmp, bytes)?;
    if let Err(e) = std::fs::rename(&tmp, path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(KilnError::io(path, e));
    }
    sync_dir(dir)
}

/// Several files of one folder replaced as a group: each new file is written and flushed under a
/// temporary name as it is added (so only one file's bytes need be in memory at a time); only when
/// all are on the disk does [`FileGroup::commit`] rename them into place, in one burst of renames
/// that cannot run out of space. A failed write (a full disk), or a group dropped uncommitted,
/// removes the temporary files and leaves every old file as it was.
pub struct FileGroup {
    dir: PathBuf,
    written: Vec<(PathBuf, PathBuf)>,
}

impl FileGroup {
    pub fn new(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| KilnError::io(dir, e))?;
        Ok(Self {
            dir: dir.to_path_buf(),
            written: Vec::new(),
        })
    }

    /// Writes `bytes` as the future `name`.
    pub fn add(&mut self, name: &str, bytes: &[u8]) -> Result<()> {
        let target = self.dir.join(name);
        let tmp = temp_path(&target);
        write_synced(&tmp, bytes)?;
        self.written.push((tmp, target));
        Ok(())
    }

    /// Renames every written file into place and flushes the folder.
    pub fn commit(mut self) -> Result<()> {
        let written = std::mem::take(&mut self.written);
        for (i, (tmp, target)) in written.iter().enumerate() {
            crash_point("replace_files:rename");
            if let Err(e) = std::fs::rename(tmp, target) {
                for (t, _) in &written[i..] {
                    let _ = std::fs::remove_file(t);
                }
                return Err(KilnError::io(target, e));
            }
        }
        sync_dir(&self.dir)
    }
}

impl Drop for FileGroup {
    fn drop(&mut self) {
        for (tmp, _) in &self.written {
            let _ = std::fs::remove_file(tmp);
        }
    }
}

/// [`FileGroup`] for files already in memory.
pub fn replace_files(dir: &Path, files: &[(&str, &[u8])]) -> Result<()> {
    let mut group = FileGroup::new(dir)?;
    for (name, bytes) in files {
        group.add(name, bytes)?;
    }
    group.commit()
}

/// Deletes a folder: renamed to a `.trash-` name beside it (atomic), flushed, then removed. A crash
/// at any point leaves either the whole folder under its name or a `.trash-` folder that
/// [`remove_leftovers`] clears.
pub fn remove_dir(path: &Path) -> Result<()> {
    let parent = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("dir");
    let trash = parent.join(format!("{TRASH_PREFIX}{name}-{}", std::process::id()));
    std::fs::rename(path, &trash).map_err(|e| KilnError::io(path, e))?;
    sync_dir(parent)?;
    crash_point("remove_dir:renamed");
    std::fs::remove_dir_all(&trash).map_err(|e| KilnError::io(&trash, e))
}

/// Removes what an interrupted run left in `dir`: folders and files whose names start with one of
/// `prefixes` (kiln's own temporary and trash names). Returns the names removed.
pub fn remove_leftovers(dir: &Path, prefixes: &[&str]) -> Result<Vec<String>> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(Vec::new());
    };
    let mut removed = Vec::new();
    for entry in entries.filter_map(|e| e.ok()) {
        let name = entry.file_name().to_string_lossy().to_string();
        if !prefixes.iter().any(|p| name.starts_with(p)) {
            continue;
        }
        let path = entry.path();
        let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
        let r = if is_dir {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        r.map_err(|e| KilnError::io(&path, e))?;
        removed.push(name);
    }
    Ok(removed)
}

/// `path` with its symlinks, `.` and `..` resolved, whether or not it exists yet: the deepest
/// existing ancestor is resolved by the file system and the rest appended, so two spellings of one
/// folder (relative and absolute, through a symlink, with `..`) give the same path.
pub fn real_path(path: &Path) -> PathBuf {
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut existing = absolute.as_path();
    let mut rest = Vec::new();
    loop {
        if let Ok(real) = existing.canonicalize() {
            return rest.iter().rev().fold(real, |p: PathBuf, part| match part {
                std::path::Component::ParentDir => p.parent().map_or(p.clone(), Path::to_path_buf),
                std::path::Component::CurDir => p,
                other => p.join(other),
            });
        }
        match (existing.parent(), existing.components().next_back()) {
            (Some(parent), Some(last)) => {
                rest.push(last);
                existing = parent;
            }
            _ => return absolute,
        }
    }
}

/// Whether `a` and `b` name the same file or folder (see [`real_path`]).
pub fn same_path(a: &Path, b: &Path) -> bool {
    real_path(a) == real_path(b)
}

/// [`write_new_folder`]'s refusals, for a command to make before its slow part.
pub fn check_new_folder(out: &Path, flag: &str, inputs: &[(&str, &Path)]) -> Result<()> {
    for (role, input) in inputs {
        if same_path(out, input) {
            return Err(KilnError::Config(format!(
                "{flag} {}: that is the {role} ({}), which this command reads; writing there \
                 would destroy it: give a new folder",
                out.display(),
                input.display()
            )));
        }
    }
    if out.exists() {
        let mut entries = std::fs::read_dir(out).map_err(|e| KilnError::io(out, e))?;
        if entries.next().is_some() {
            return Err(KilnError::Config(format!(
                "{flag} {}: the folder exists and is not empty, and nothing in it is replaced; \
                 choose a new folder",
                out.display()
            )));
        }
    }
    Ok(())
}

/// The rule of every command that writes a new folder from input folders (`kiln merge`, `kiln
/// convert`): `out` may not be one of `inputs` (`(role, path)`, compared by real path) nor a
/// folder that already holds files (a training run, another model), and the folder appears whole
/// or not at all: `write` fills a temporary folder beside `out`, renamed into place once complete.
pub fn write_new_folder(
    out: &Path,
    flag: &str,
    inputs: &[(&str, &Path)],
    write: impl FnOnce(&Path) -> Result<()>,
) -> Result<()> {
    check_new_folder(out, flag, inputs)?;
    let parent = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| KilnError::io(parent, e))?;
    let name = out
        .file_name()
        .map_or("out".into(), |n| n.to_string_lossy());
    let tmp = parent.join(format!("{TEMP_PREFIX}{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir(&tmp).map_err(|e| KilnError::io(&tmp, e))?;
    if let Err(e) = write(&tmp) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if out.exists() {
        std::fs::remove_dir(out).map_err(|e| KilnError::io(out, e))?;
    }
    if let Err(e) = std::fs::rename(&tmp, out) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(KilnError::io(out, e));
    }
    sync_dir(parent)
}

/// Reads a whole file that must be a regular file (not a device such as `/dev/zero`, a pipe or a
/// folder, which could make the read endless). `what` names the file's role in the error.
pub fn read_regular(path: &Path, what: &str) -> Result<Vec<u8>> {
    ensure_regular(path, what)?;
    std::fs::read(path).map_err(|e| KilnError::io(path, e))
}

/// An error unless `path` is a regular file (symlinks are followed): a device such as `/dev/zero`,
/// a FIFO or a directory would block, fail obscurely or grow memory without end.
pub fn ensure_regular(path: &Path, what: &str) -> Result<()> {
    let meta = std::fs::metadata(path).map_err(|e| KilnError::io(path, e))?;
    if meta.is_file() {
        return Ok(());
    }
    let kind = if meta.is_dir() {
        "a directory"
    } else {
        "a device, FIFO or socket"
    };
    Err(KilnError::Config(format!(
        "{}: not a regular file ({kind}); give a {what}",
        path.display()
    )))
}

/// Test hook for crash-consistency tests: with `KILN_TEST_CRASH_AT=NAME:N` in the environment, the
/// process kills itself with SIGKILL the N-th time it passes the point `NAME` (1-based), as a
/// power cut or the OOM killer would stop it there. Without the variable this is one relaxed load.
/// Under a launcher only the first attempt dies (`TORCHELASTIC_RESTART_COUNT` 0: a restarted
/// worker goes on), and with `KILN_TEST_CRASH_RANK=R` only the worker of global rank R. With
/// `KILN_TEST_CRASH_MODE=hang` the process stops there forever instead (a hung worker).
pub fn crash_point(name: &str) {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;
    static TARGET: OnceLock<Option<(String, u64)>> = OnceLock::new();
    static HITS: AtomicU64 = AtomicU64::new(0);
    let target = TARGET.get_or_init(|| {
        let v = std::env::var("KILN_TEST_CRASH_AT").ok()?;
        let var = |k: &str| std::env::var(k).ok();
        if var("TORCHELASTIC_RESTART_COUNT").is_some_and(|r| r != "0") {
            return None;
        }
        if let Some(rank) = var("KILN_TEST_CRASH_RANK") {
            if var("RANK").as_deref() != Some(rank.as_str()) {
                return None;
            }
        }
        let (point, n) = v.rsplit_once(':')?;
        Some((point.to_string(), n.parse().ok()?))
    });
    if let Some((point, n)) = target {
        if point == name && HITS.fetch_add(1, Ordering::Relaxed) + 1 == *n {
            if std::env::var("KILN_TEST_CRASH_MODE").as_deref() == Ok("hang") {
                loop {
                    std::thread::sleep(std::time::Duration::from_secs(3600));
                }
            }
            // SAFETY: sends SIGKILL to this very process; nothing runs after it.
            unsafe {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replace_files_is_all_or_nothing() {
        let dir = tempfile::tempdir().unwrap();
        replace_files(dir.path(), &[("a", b"old a"), ("b", b"old b")]).unwrap();
        // A file name that cannot be created (a folder is in the way) fails the group: the first
        // file keeps its old content and no temporary file is left.
        std::fs::create_dir(temp_path(&dir.path().join("c"))).unwrap();
        let err = replace_files(dir.path(), &[("a", b"new a"), ("c", b"new c")]);
        assert!(err.is_err());
        assert_eq!(std::fs::read(dir.path().join("a")).unwrap(), b"old a");
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
            .filter(|n| n.starts_with(&format!("{TEMP_PREFIX}a")))
            .collect();
        assert!(names.is_empty(), "temporary files left: {names:?}");
    }

    #[test]
    fn a_new_folder_is_never_an_input_by_another_spelling_nor_a_full_folder() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("base");
        std::fs::create_dir_all(base.join("sub")).unwrap();
        std::fs::write(base.join("model.safetensors"), b"weights").unwrap();
        std::os::unix::fs::symlink(&base, dir.path().join("link")).unwrap();
        let write = |out: &Path| {
            write_new_folder(out, "--out", &[("base model", &base)], |tmp| {
                std::fs::write(tmp.join("model.safetensors"), b"merged")
                    .map_err(|e| KilnError::io(tmp, e))
            })
        };
        // The base named through a symlink, with `..`, with `.`: each is the base.
        for spelling in [
            dir.path().join("link"),
            base.join("sub/.."),
            base.join("."),
            dir.path().join("nothing/../base"),
        ] {
            let e = write(&spelling).unwrap_err().to_string();
            assert!(e.contains("that is the base model"), "{spelling:?}: {e}");
        }
        assert_eq!(
            std::fs::read(base.join("model.safetensors")).unwrap(),
            b"weights"
        );
        // A folder holding files is refused; an empty or new one is written whole.
        std::fs::create_dir(dir.path().join("run")).unwrap();
        std::fs::write(dir.path().join("run/trainer_state.json"), b"{}").unwrap();
        let e = write(&dir.path().join("run")).unwrap_err().to_string();
        assert!(e.contains("not empty"), "{e}");
        std::fs::create_dir(dir.path().join("empty")).unwrap();
        for out in ["empty", "new/deeper"] {
            write(&dir.path().join(out)).unwrap();
            assert_eq!(
                std::fs::read(dir.path().join(out).join("model.safetensors")).unwrap(),
                b"merged"
            );
        }
        // A failed write leaves nothing behind.
        let failed = write_new_folder(&dir.path().join("failed"), "--out", &[], |_| {
            Err(KilnError::Config("disk full".into()))
        });
        assert!(failed.is_err());
        let left: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
            .filter(|n| n.starts_with(TEMP_PREFIX) || n == "failed")
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }

    #[test]
    fn remove_dir_and_leftovers() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("checkpoint-3");
        std::fs::create_dir_all(victim.join("sub")).unwrap();
        std::fs::write(victim.join("sub/x"), b"x").unwrap();
        remove_dir(&victim).unwrap();
        assert!(!victim.exists());
        std::fs::create_dir(dir.path().join(".kiln-trash-checkpoint-1-99")).unwrap();
        std::fs::write(dir.path().join(".kiln-tmp-x"), b"").unwrap();
        std::fs::write(dir.path().join("keep"), b"").unwrap();
        let mut removed = remove_leftovers(dir.path(), &[TRASH_PREFIX, TEMP_PREFIX]).unwrap();
        removed.sort();
        assert_eq!(removed, vec![".kiln-tmp-x", ".kiln-trash-checkpoint-1-99"]);
        assert!(dir.path().join("keep").exists());
    }

    #[test]
    fn devices_are_not_read() {
        let e = read_regular(Path::new("/dev/zero"), "weights file").unwrap_err();
        assert!(
            e.to_string()
                .contains("/dev/zero: not a regular file (a device"),
            "{e}"
        );
    }
}
