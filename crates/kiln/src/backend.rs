//! Every Burn backend type kiln uses lives here, so changing or adding a backend is a one-file change.

use std::path::PathBuf;

pub use burn::backend::Autodiff;
use burn::tensor::backend::Backend;

use crate::error::{KilnError, Result};

/// The CPU backend: pure-Rust ndarray, multi-threaded GEMM with SIMD kernels.
pub type Cpu = burn::backend::NdArray<f32>;
/// The CPU backend with reverse-mode autodiff, for training.
pub type CpuTrain = burn::backend::Autodiff<Cpu>;
pub type CpuDevice = burn::backend::ndarray::NdArrayDevice;

/// NVIDIA GPUs through CubeCL's CUDA runtime (kernels compiled at run time; no toolkit to build).
#[cfg(feature = "cuda")]
pub type Cuda = burn::backend::Cuda<f32, i32>;
#[cfg(feature = "cuda")]
pub type CudaTrain = burn::backend::Autodiff<Cuda>;
#[cfg(feature = "cuda")]
pub type CudaDevice = burn::backend::cuda::CudaDevice;

/// Any Vulkan / Metal / DX12 GPU through wgpu, CubeCL's kernels compiled to its shaders; Mesa's
/// software Vulkan (lavapipe) when the machine has no GPU.
#[cfg(feature = "wgpu")]
pub type Wgpu = burn::backend::Wgpu<f32, i32, u32>;
#[cfg(feature = "wgpu")]
pub type WgpuTrain = burn::backend::Autodiff<Wgpu>;
#[cfg(feature = "wgpu")]
pub type WgpuDevice = burn::backend::wgpu::WgpuDevice;

/// How the process's allocator is told to give freed memory back to the system (`true`) or to
/// keep it again (`false`), where it keeps it otherwise: the CLI's mimalloc keeps freed pages to
/// spare training steps page faults.
static FREED_MEMORY_RELEASE: std::sync::OnceLock<fn(bool)> = std::sync::OnceLock::new();

/// Sets the switch [`releasing_freed_memory`] uses (once per process; later calls are ignored).
pub fn set_freed_memory_release(switch: fn(bool)) {
    let _ = FREED_MEMORY_RELEASE.set(switch);
}

/// Runs `f`, which frees a large part of memory for good (the f32 base that `--base-dtype bf16`
/// replaces), with what it frees given back to the system: through the registered switch, else
/// glibc's `malloc_trim` afterwards.
pub fn releasing_freed_memory<T>(f: impl FnOnce() -> T) -> T {
    let switch = FREED_MEMORY_RELEASE.get();
    if let Some(switch) = switch {
        switch(true);
    }
    let out = f();
    match switch {
        Some(switch) => switch(false),
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: malloc_trim only returns free pages of the allocator's arenas to the system.
        None => unsafe {
            libc::malloc_trim(0);
        },
        #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
        None => {}
    }
    out
}

/// Seeds the backend's random generator (initialisation, dropout).
pub fn seed<B: Backend>(device: &B::Device, seed: u64) {
    B::seed(device, seed);
}

/// Where a run executes: `cpu`, `cuda`, `cuda:N` or `wgpu`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    #[default]
    Cpu,
    /// The N-th CUDA device.
    Cuda(usize),
    /// wgpu's default adapter (a GPU, else a software Vulkan).
    Wgpu,
}

impl std::str::FromStr for DeviceSpec {
    type Err = KilnError;
    fn from_str(s: &str) -> Result<Self> {
        let bad = || {
            KilnError::Config(format!(
                "unknown device {s:?} (use cpu, cuda, cuda:N or wgpu)"
            ))
        };
        match s.to_ascii_lowercase().as_str() {
            "cpu" => Ok(Self::Cpu),
            "wgpu" => Ok(Self::Wgpu),
            "cuda" | "gpu" => Ok(Self::Cuda(0)),
            other => match other.strip_prefix("cuda:") {
                Some(n) => n.parse().map(Self::Cuda).map_err(|_| bad()),
                None => Err(bad()),
            },
        }
    }
}

impl DeviceSpec {
    /// An error when this build cannot run on the device.
    pub fn check_available(self) -> Result<()> {
        match self {
            Self::Cpu => Ok(()),
            Self::Cuda(_) if cfg!(feature = "cuda") => Ok(()),
            Self::Cuda(_) => Err(KilnError::Config(
                "this kiln was built without CUDA support: rebuild with `cargo build --release -p kiln-cli --features cuda`".into(),
            )),
            Self::Wgpu if cfg!(feature = "wgpu") => Ok(()),
            Self::Wgpu => Err(KilnError::Config(
                "this kiln was built without wgpu support: rebuild with `cargo build --release -p kiln-cli --features wgpu`".into(),
            )),
        }
    }
}

/// Where runtime-compiled GPU kernels and autotune results persist between runs, so a second run
/// starts without compiling: `$KILN_CACHE_DIR`, else `$XDG_CACHE_HOME/kiln/kernels`, else
/// `~/.cache/kiln/kernels`.
pub fn kernel_cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("KILN_CACHE_DIR") {
        return PathBuf::from(d);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("kiln").join("kernels")
}

/// How CubeCL finds memory for each new GPU buffer (`KILN_GPU_MEMORY`).
#[cfg(any(feature = "cuda", feature = "wgpu"))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuMemory {
    /// CubeCL's default (`pooled`): buffers cut from large pages; a free buffer of the same
    /// padded size is reused whole, and free neighbours are merged when nothing fits. Upstream
    /// re-indexed every page on each new buffer, most of a BERT-base step's host time on an H200;
    /// kiln's patched `cubecl-runtime` does not (third_party/cubecl-runtime/PATCHES.md).
    Pooled,
    /// Buffers kept per exact size and reused whole (`persistent`): a lookup by size, no merging.
    /// Memory for a size is never given back, so many distinct shapes (dynamic padding without
    /// `--pad-to-multiple-of`) hold more of it (three times `pooled`'s on the tweets run).
    Persistent,
}

#[cfg(any(feature = "cuda", feature = "wgpu"))]
impl GpuMemory {
    /// From `KILN_GPU_MEMORY` (`pooled` when unset).
    pub fn from_env() -> Result<Self> {
        Self::parse(std::env::var("KILN_GPU_MEMORY").ok().as_deref())
    }

    /// `KILN_GPU_MEMORY`'s value (`None`: unset).
    pub fn parse(value: Option<&str>) -> Result<Self> {
        match value {
            None | Some("pooled") => Ok(Self::Pooled),
            Some("persistent") => Ok(Self::Persistent),
            Some(other) => Err(KilnError::Config(format!(
                "KILN_GPU_MEMORY={other:?} is not one of `pooled`, `persistent`"
            ))),
        }
    }
}

/// Checks that `KILN_GPU_MEMORY_TRACE`'s file (the patched CubeCL's memory trace,
/// third_party/cubecl-runtime/PATCHES.md) can be written, so a bad path is one sentence here and
/// not a panic on CubeCL's device thread when its first pool is made.
#[cfg(any(feature = "cuda", feature = "wgpu"))]
fn check_memory_trace(path: Option<&std::ffi::OsStr>) -> Result<()> {
    match path {
        Some(path) => std::fs::File::create(path).map(drop).map_err(|e| {
            KilnError::Config(format!(
                "KILN_GPU_MEMORY_TRACE={}: the memory trace cannot be written there: {e}",
                std::path::Path::new(path).display()
            ))
        }),
        None => Ok(()),
    }
}

/// Points CubeCL's compiled-kernel (PTX) cache and autotune cache at [`kernel_cache_dir`] and sets
/// its memory mode ([`GpuMemory`]). Must run before the first GPU kernel; later calls do nothing.
#[cfg(any(feature = "cuda", feature = "wgpu"))]
pub fn init_kernel_cache() -> Result<()> {
    use burn_cubecl::cubecl::config::{cache::CacheConfig, memory::PersistentMemory, GlobalConfig};
    let memory = GpuMemory::from_env()?;
    check_memory_trace(std::env::var_os("KILN_GPU_MEMORY_TRACE").as_deref())?;
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let dir = kernel_cache_dir().join(build_key());
        // CubeCL's own variables (CUBECL_DEBUG_OPTION=profile, CUBECL_DEBUG_LOG, …) still apply.
        let mut config = GlobalConfig::default().override_from_env();
        config.autotune.cache = CacheConfig::File(dir.join("autotune"));
        // CubeCL adds its version, and (kiln's cubecl-cuda patch) the GPU architecture and the
        // driver's version, below this.
        config.compilation.cache = Some(CacheConfig::File(dir.join("compiled")));
        if memory == GpuMemory::Persistent {
            config.memory.persistent_memory = PersistentMemory::Enforced;
        }
        GlobalConfig::set(config);
        tracing::info!("GPU kernel cache: {}; memory {memory:?}", dir.display());
    });
    Ok(())
}

/// The cache folder of this build of kiln: CubeCL keys a compiled kernel by its name and
/// compile-time arguments, not by its source, so a kernel whose source changed between two builds
/// would be loaded stale from a shared cache. The key is kiln's version and a stamp of the running
/// executable (its size and modification time): a rebuilt program starts a new cache.
#[cfg(any(feature = "cuda", feature = "wgpu"))]
fn build_key() -> String {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    if let Some(meta) = std::env::current_exe()
        .ok()
        .and_then(|e| std::fs::metadata(e).ok())
    {
        meta.len().hash(&mut h);
        meta.modified().ok().hash(&mut h);
    }
    format!("kiln-{}-{:016x}", env!("CARGO_PKG_VERSION"), h.finish())
}

/// `(compiled, loaded from the cache)`: the GPU kernels this process has needed so far (CUDA;
/// `None` elsewhere).
pub fn kernel_compilations() -> Option<(u64, u64)> {
    #[cfg(feature = "cuda")]
    {
        Some(burn_cubecl::cubecl::cuda::kernel_compilations())
    }
    #[cfg(not(feature = "cuda"))]
    {
        None
    }
}

/// Size in bytes and file count of the kernel cache.
pub fn kernel_cache_usage() -> (u64, usize) {
    folder_usage(&kernel_cache_dir())
}

/// Size in bytes and file count of the files under `dir` (symlinks not followed).
fn folder_usage(dir: &std::path::Path) -> (u64, usize) {
    fn walk(p: &std::path::Path, acc: &mut (u64, usize)) {
        let Ok(entries) = std::fs::read_dir(p) else {
            return;
        };
        for e in entries.flatten() {
            match e.file_type() {
                Ok(t) if t.is_dir() => walk(&e.path(), acc),
                Ok(_) => {
                    acc.0 += e.metadata().map_or(0, |m| m.len());
                    acc.1 += 1;
                }
                Err(_) => {}
            }
        }
    }
    let mut acc = (0, 0);
    walk(dir, &mut acc);
    acc
}

/// Whether a name in the cache folder is one of kiln's build folders (`kiln-<version>-<16 hex
/// digits>`, see `build_key`): `KILN_CACHE_DIR` may point at a folder that holds other things.
fn is_build_folder(name: &str) -> bool {
    name.strip_prefix("kiln-")
        .and_then(|rest| rest.rsplit_once('-'))
        .is_some_and(|(version, hash)| {
            !version.is_empty() && hash.len() == 16 && hash.bytes().all(|b| b.is_ascii_hexdigit())
        })
}

/// What [`clean_kernel_cache`] did.
#[derive(Debug, Default)]
pub struct CacheCleaned {
    /// Bytes and files removed.
    pub bytes: u64,
    pub files: usize,
    /// Entries of the cache folder that are not kiln's, left as they were.
    pub kept: Vec<String>,
}

/// Deletes kiln's compiled kernels and autotune results: the build folders kiln wrote in
/// [`kernel_cache_dir`], nothing else there (the folder may be a user's, through `KILN_CACHE_DIR`).
pub fn clean_kernel_cache() -> Result<CacheCleaned> {
    clean_cache_folder(&kernel_cache_dir())
}

fn clean_cache_folder(dir: &std::path::Path) -> Result<CacheCleaned> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(CacheCleaned::default()),
        Err(e) => return Err(KilnError::io(dir, e)),
    };
    let mut done = CacheCleaned::default();
    for entry in entries {
        let entry = entry.map_err(|e| KilnError::io(dir, e))?;
        let name = entry.file_name().to_string_lossy().to_string();
        let path = entry.path();
        // A symlink is never followed out of the cache, even when it has a build folder's name.
        let real_dir = entry.file_type().is_ok_and(|t| t.is_dir());
        if !(real_dir && is_build_folder(&name)) {
            done.kept.push(name);
            continue;
        }
        let (bytes, files) = folder_usage(&path);
        std::fs::remove_dir_all(&path).map_err(|e| KilnError::io(&path, e))?;
        done.bytes += bytes;
        done.files += files;
    }
    done.kept.sort();
    Ok(done)
}

/// How long CubeCL itself lets a cache lock stand before it takes it over (`cubecl-common`'s
/// default `lock_max_duration`).
pub const KERNEL_CACHE_LOCK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Removes the kernel cache's lock files older than `min_age` (`*.lock` beside each cache file);
/// returns how many were removed and how many were kept as possibly held.
///
/// CubeCL takes a cache file by creating `<file>.lock` holding a timestamp, and takes over a lock
/// older than 30 s. A process killed between creating the lock and writing its timestamp leaves a
/// lock it cannot read, and then every later run waits on it forever: this clears it.
pub fn clear_kernel_cache_locks(min_age: std::time::Duration) -> Result<(usize, usize)> {
    fn walk(
        p: &std::path::Path,
        min_age: std::time::Duration,
        acc: &mut (usize, usize),
    ) -> Result<()> {
        let Ok(entries) = std::fs::read_dir(p) else {
            return Ok(());
        };
        for e in entries.flatten() {
            let path = e.path();
            match e.file_type() {
                Ok(t) if t.is_dir() => walk(&path, min_age, acc)?,
                Ok(_) if path.extension().is_some_and(|x| x == "lock") => {
                    let age = e
                        .metadata()
                        .and_then(|m| m.modified())
                        .ok()
                        .and_then(|t| t.elapsed().ok())
                        .unwrap_or_default();
                    if age < min_age {
                        acc.1 += 1;
                        continue;
                    }
                    match std::fs::remove_file(&path) {
                        Ok(()) => acc.0 += 1,
                        // Its holder finished meanwhile.
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                        Err(e) => return Err(KilnError::io(&path, e)),
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }
    let mut acc = (0, 0);
    walk(&kernel_cache_dir(), min_age, &mut acc)?;
    Ok(acc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cleaning_the_cache_removes_only_kilns_build_folders() {
        let dir = tempfile::tempdir().unwrap();
        let build = dir.path().join("kiln-0.1.0-0123456789abcdef");
        std::fs::create_dir_all(build.join("compiled")).unwrap();
        std::fs::write(build.join("compiled/k.ptx"), b"ptx").unwrap();
        // What a user keeps in the folder KILN_CACHE_DIR names, kiln-like names included.
        std::fs::write(dir.path().join("notes.txt"), b"mine").unwrap();
        std::fs::create_dir(dir.path().join("kiln-data")).unwrap();
        std::fs::create_dir(dir.path().join("outside")).unwrap();
        std::fs::write(dir.path().join("outside/keep"), b"mine").unwrap();
        std::os::unix::fs::symlink(
            dir.path().join("outside"),
            dir.path().join("kiln-0.2.0-fedcba9876543210"),
        )
        .unwrap();
        let done = clean_cache_folder(dir.path()).unwrap();
        assert_eq!((done.files, done.bytes), (1, 3));
        assert!(!build.exists());
        assert_eq!(
            done.kept,
            [
                "kiln-0.2.0-fedcba9876543210",
                "kiln-data",
                "notes.txt",
                "outside"
            ]
        );
        assert!(dir.path().join("outside/keep").exists());
        assert!(dir.path().join("notes.txt").exists());
    }

    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    #[test]
    fn gpu_memory_modes_parse_and_anything_else_is_named() {
        assert_eq!(GpuMemory::parse(None).unwrap(), GpuMemory::Pooled);
        assert_eq!(GpuMemory::parse(Some("pooled")).unwrap(), GpuMemory::Pooled);
        assert_eq!(
            GpuMemory::parse(Some("persistent")).unwrap(),
            GpuMemory::Persistent
        );
        let e = GpuMemory::parse(Some("exclusive")).unwrap_err().to_string();
        assert!(e.contains("KILN_GPU_MEMORY=\"exclusive\""), "{e}");
    }

    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    #[test]
    fn a_memory_trace_that_cannot_be_written_is_named() {
        let dir = tempfile::tempdir().unwrap();
        check_memory_trace(None).unwrap();
        let ok = dir.path().join("memory.trace");
        check_memory_trace(Some(ok.as_os_str())).unwrap();
        assert!(ok.exists());
        let bad = dir.path().join("missing/memory.trace");
        let e = check_memory_trace(Some(bad.as_os_str()))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("KILN_GPU_MEMORY_TRACE=") && e.contains("missing/memory.trace"),
            "{e}"
        );
    }

    #[test]
    fn device_specs_parse() {
        assert_eq!("cpu".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cpu);
        assert_eq!("cuda".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(0));
        assert_eq!("CUDA:3".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(3));
        let e = "tpu".parse::<DeviceSpec>().unwrap_err().to_string();
        assert!(e.contains("cpu, cuda, cuda:N or wgpu"), "{e}");
        assert_eq!("wgpu".parse::<DeviceSpec>().unwrap(), DeviceSpec::Wgpu);
        assert!("cuda:x".parse::<DeviceSpec>().is_err());
    }
}
