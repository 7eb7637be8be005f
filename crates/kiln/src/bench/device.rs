//! A row's GPU counters over its timed steps: kernel launches per step, the allocator's largest
//! reservation, and the host's share of a step (the time until it waits for the loss). PyTorch's
//! side reports the same three (scripts/bench_reference_cuda.py), so the bench sets them side by
//! side. Nothing is recorded on the CPU.

use super::BenchResult;
use crate::ops::{DeviceCounters, KilnBackend};

/// Samples `B`'s counters around timed steps.
pub struct DeviceSampler<B: KilnBackend> {
    device: B::Device,
    start: Option<DeviceCounters>,
    peak_reserved: u64,
    host_secs: Vec<f64>,
}

impl<B: KilnBackend> DeviceSampler<B> {
    pub fn new(device: &B::Device) -> Self {
        Self {
            device: device.clone(),
            start: None,
            peak_reserved: 0,
            host_secs: Vec::new(),
        }
    }

    /// Call before the first timed step.
    pub fn start(&mut self) {
        self.start = B::kiln_device_counters(&self.device);
    }

    /// Call after each timed step (once the device is idle), with the seconds the host spent
    /// queueing it.
    pub fn step_done(&mut self, host_secs: f64) {
        if let Some(now) = B::kiln_device_counters(&self.device) {
            self.peak_reserved = self.peak_reserved.max(now.reserved_bytes);
            self.host_secs.push(host_secs);
        }
    }

    /// Writes the counters into `r` (on a GPU only).
    pub fn finish(&self, r: &mut BenchResult) {
        let (Some(start), Some(end)) = (self.start, B::kiln_device_counters(&self.device)) else {
            return;
        };
        let steps = self.host_secs.len().max(1) as f64;
        r.launches_per_step = match (start.launches, end.launches) {
            (Some(a), Some(b)) => Some((b - a) as f64 / steps),
            _ => None,
        };
        r.gpu_reserved_mib = Some(self.peak_reserved.max(end.reserved_bytes) as f64 / 1048576.0);
        r.host_ms_per_step = Some(self.host_secs.iter().sum::<f64>() / steps * 1e3);
    }
}
