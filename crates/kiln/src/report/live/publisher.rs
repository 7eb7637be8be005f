//! The writing side: a rank's [`LivePublisher`] keeps its state under a lock the training thread
//! updates, and a background thread writes it to `live/rank-N.json` every [`INTERVAL`] with the
//! process's CPU time, resident memory and GPU figures sampled beside it.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use super::*;
use crate::error::{KilnError, Result};

/// The state and the recent steps the rates come from.
pub(super) struct Shared {
    state: RankState,
    /// (seconds, samples, tokens) of the last steps.
    recent: VecDeque<(f64, usize, usize)>,
}

/// Publishes one rank's state until dropped (then writes its last state once more).
pub struct LivePublisher {
    shared: Arc<Mutex<Shared>>,
    stop: Option<mpsc::Sender<()>>,
    writer: Option<JoinHandle<()>>,
    job_entry: Option<PathBuf>,
}

impl LivePublisher {
    /// Starts publishing rank `rank` of `world_size` into `output_dir/live/`. `gpu` is the index
    /// of the GPU this rank trains on (NVML then reports its load; a missing driver just leaves
    /// it out).
    pub fn start(
        output_dir: &Path,
        rank: usize,
        world_size: usize,
        gpu: Option<u32>,
    ) -> Result<Self> {
        Self::start_in(output_dir, rank, world_size, gpu, &runtime_dir())
    }

    /// [`Self::start`], registering the job in `runtime` instead of [`runtime_dir`].
    pub fn start_in(
        output_dir: &Path,
        rank: usize,
        world_size: usize,
        gpu: Option<u32>,
        runtime: &Path,
    ) -> Result<Self> {
        let dir = output_dir.join("live");
        std::fs::create_dir_all(&dir).map_err(|e| KilnError::io(&dir, e))?;
        let abs = std::path::absolute(output_dir).unwrap_or_else(|_| output_dir.to_path_buf());
        let now = unix_now();
        let state = RankState {
            rank,
            world_size,
            pid: std::process::id(),
            host: hostname(),
            output_dir: abs.display().to_string(),
            started_unix: now,
            last_step_unix: now,
            ..RankState::default()
        };
        let shared = Arc::new(Mutex::new(Shared {
            state,
            recent: VecDeque::with_capacity(RATE_WINDOW + 1),
        }));
        let path = rank_file(output_dir, rank);
        // A rank that cannot write its state says so once and trains on.
        write_state(&path, &lock(&shared).state).map_err(|e| KilnError::io(&path, e))?;
        let job_entry = register_job(runtime, &abs, rank);
        let (tx, rx) = mpsc::channel::<()>();
        let thread_shared = Arc::clone(&shared);
        let writer = std::thread::Builder::new()
            .name(format!("kiln-live-{rank}"))
            .spawn(move || publish_loop(&path, &thread_shared, &rx, gpu))
            .map_err(|e| KilnError::io(&dir, e))?;
        Ok(Self {
            shared,
            stop: Some(tx),
            writer: Some(writer),
            job_entry,
        })
    }

    /// Records a finished optimizer step.
    pub fn step(&self, s: &StepReport) {
        let mut g = lock(&self.shared);
        g.recent.push_back((s.seconds, s.samples, s.tokens));
        if g.recent.len() > RATE_WINDOW {
            g.recent.pop_front();
        }
        let (secs, samples, tokens) = g
            .recent
            .iter()
            .fold((0.0, 0, 0), |a, r| (a.0 + r.0, a.1 + r.1, a.2 + r.2));
        let n = g.recent.len() as f64;
        let st = &mut g.state;
        st.phase = Phase::Training;
        st.step = s.step;
        st.total_steps = s.total_steps;
        st.epoch = s.epoch;
        st.loss = s.loss.is_finite().then_some(s.loss);
        st.learning_rate = Some(s.learning_rate);
        st.grad_norm = s.grad_norm.is_finite().then_some(s.grad_norm);
        st.compute_seconds += (s.seconds - s.collective_seconds).max(0.0);
        st.collective_seconds += s.collective_seconds;
        st.step_seconds = secs / n;
        st.samples_per_second = samples as f64 / secs.max(1e-9);
        st.tokens_per_second = tokens as f64 / secs.max(1e-9);
        st.eta_seconds = Some(s.total_steps.saturating_sub(s.step) as f64 * st.step_seconds);
        st.last_step_unix = unix_now();
        if st.loss_history.len() == LOSS_HISTORY {
            st.loss_history.remove(0);
        }
        if let Some(l) = st.loss {
            st.loss_history.push(l);
        }
    }

    /// Sets what the rank is doing (evaluating, saving, ...); `total_steps` once it is known.
    pub fn phase(&self, phase: Phase) {
        lock(&self.shared).state.phase = phase;
    }

    pub fn set_total_steps(&self, total: u64, step: u64) {
        let mut g = lock(&self.shared);
        g.state.total_steps = total;
        g.state.step = step;
    }

    /// Marks the run failed with its error (written at once).
    pub fn fail(&self, error: &str) {
        let mut g = lock(&self.shared);
        g.state.phase = Phase::Failed;
        g.state.error = Some(error.to_string());
    }

    /// The state as it stands.
    pub fn snapshot(&self) -> RankState {
        lock(&self.shared).state.clone()
    }
}

impl Drop for LivePublisher {
    fn drop(&mut self) {
        // Closing the channel wakes the writer, which writes the last state and returns.
        drop(self.stop.take());
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
        if let Some(p) = &self.job_entry {
            let _ = std::fs::remove_file(p);
        }
    }
}

pub(super) fn lock(m: &Mutex<Shared>) -> std::sync::MutexGuard<'_, Shared> {
    // A panic elsewhere while holding the lock leaves plain data: keep publishing it.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub(super) fn publish_loop(
    path: &Path,
    shared: &Mutex<Shared>,
    stop: &mpsc::Receiver<()>,
    gpu: Option<u32>,
) {
    let mut cpu = CpuClock::new();
    let mut nvml = gpu.and_then(Gpu::open);
    let mut warned = false;
    loop {
        // A message or a closed channel: write once more and stop.
        let last = !matches!(stop.recv_timeout(INTERVAL), Err(RecvTimeoutError::Timeout));
        let (cpu_percent, rss) = (cpu.percent(), resident_bytes());
        let gpu_state = nvml.as_mut().and_then(Gpu::sample);
        let state = {
            let mut g = lock(shared);
            let st = &mut g.state;
            st.cpu_percent = cpu_percent;
            st.rss_bytes = rss;
            st.gpu = gpu_state;
            st.heartbeat_unix = unix_now();
            st.clone()
        };
        if let Err(e) = write_state(path, &state) {
            if !warned {
                tracing::warn!("cannot publish the live state to {}: {e}", path.display());
                warned = true;
            }
        }
        if last {
            return;
        }
    }
}

pub(super) fn write_state(path: &Path, state: &RankState) -> std::io::Result<()> {
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_vec(state).expect("plain data"))?;
    std::fs::rename(&tmp, path)
}

/// This process's CPU time, turned into a percentage of one core between calls.
pub(super) struct CpuClock {
    last: Option<(Instant, f64)>,
}

impl CpuClock {
    fn new() -> Self {
        Self { last: None }
    }

    fn percent(&mut self) -> f64 {
        let Some(cpu) = process_cpu_seconds() else {
            return 0.0;
        };
        let now = Instant::now();
        let p = match self.last {
            Some((t, c)) => 100.0 * (cpu - c) / now.duration_since(t).as_secs_f64().max(1e-6),
            None => 0.0,
        };
        self.last = Some((now, cpu));
        p
    }
}

/// User + system CPU seconds of this process (all threads).
pub(super) fn process_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which may hold spaces) start at ") ".
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let (utime, stime): (f64, f64) = (f.get(11)?.parse().ok()?, f.get(12)?.parse().ok()?);
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Some((utime + stime) / ticks)
}

/// Resident memory of this process.
pub(super) fn resident_bytes() -> u64 {
    let pages = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as u64;
    pages * page
}

/// One GPU through NVML (libnvidia-ml loaded at run time).
pub(super) struct Gpu {
    nvml: nvml_wrapper::Nvml,
    index: u32,
}

impl Gpu {
    fn open(index: u32) -> Option<Self> {
        match nvml_wrapper::Nvml::init() {
            Ok(nvml) => Some(Self { nvml, index }),
            Err(e) => {
                tracing::debug!("no GPU figures in the live state: NVML: {e}");
                None
            }
        }
    }

    fn sample(&mut self) -> Option<GpuState> {
        let d = self.nvml.device_by_index(self.index).ok()?;
        let util = d.utilization_rates().ok()?;
        let mem = d.memory_info().ok()?;
        Some(GpuState {
            index: self.index,
            utilization_percent: util.gpu,
            memory_used_bytes: mem.used,
            memory_total_bytes: mem.total,
        })
    }
}
