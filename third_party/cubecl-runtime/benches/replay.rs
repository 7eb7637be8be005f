//! kiln: replays a memory trace (`KILN_GPU_MEMORY_TRACE`, src/memory_management/trace.rs)
//! against CubeCL's memory manager on a storage that hands out addresses and no memory, and
//! prints the host time per reservation and the device memory the pools would have held.
//!
//! `cargo bench --bench replay -- TRACE [--page BYTES] [--align BYTES] [--runs N] [--one-manager]
//! [--persistent]`
//! (default: one H200's pools, 143,771 MiB / 4 pages aligned to 512 bytes, as cubecl-cuda makes
//! them; every manager in the trace replayed with them).
//!
//! The same file builds against the published crate, so both pools are timed on one trace.

use cubecl_ir::MemoryDeviceProperties;
use cubecl_runtime::{
    logging::ServerLogger,
    memory_management::{
        MemoryAllocationMode, MemoryConfiguration, MemoryManagement, MemoryManagementOptions,
        SliceHandle,
    },
    server::IoError,
    storage::{ComputeStorage, StorageHandle, StorageId, StorageUtilization},
};
use std::{collections::HashMap, sync::Arc, time::Instant};

/// Storage that only counts: what the pools ask of the device.
#[derive(Default)]
struct Counting {
    sizes: HashMap<StorageId, u64>,
    held: u64,
    peak: u64,
    allocs: u64,
}

impl ComputeStorage for Counting {
    type Resource = ();

    fn alignment(&self) -> usize {
        512
    }

    fn get(&mut self, _handle: &StorageHandle) -> Self::Resource {}

    fn alloc(&mut self, size: u64) -> Result<StorageHandle, IoError> {
        let id = StorageId::new();
        self.sizes.insert(id, size);
        self.held += size;
        self.peak = self.peak.max(self.held);
        self.allocs += 1;
        Ok(StorageHandle::new(
            id,
            StorageUtilization { offset: 0, size },
        ))
    }

    fn dealloc(&mut self, id: StorageId) {
        self.held -= self.sizes.remove(&id).unwrap_or(0);
    }
}

enum Event {
    Reserve {
        manager: usize,
        buffer: u64,
        size: u64,
    },
    Free {
        buffer: u64,
    },
    Mode {
        manager: usize,
        persistent: bool,
    },
}

struct Args {
    trace: String,
    page: u64,
    align: u64,
    runs: usize,
    /// Every manager's events on one manager: wgpu keeps kernels' uniforms in a manager of
    /// their own, CUDA uploads each launch's arguments into the main one.
    one: bool,
    /// Every reservation in the persistent pool (`KILN_GPU_MEMORY=persistent`).
    persistent: bool,
}

fn args() -> Args {
    let mut out = Args {
        trace: String::new(),
        page: 143_771 * 1024 * 1024 / 4,
        align: 512,
        runs: 5,
        one: false,
        persistent: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = || it.next().expect("a value after the flag");
        match a.as_str() {
            "--page" => out.page = value().parse().expect("--page BYTES"),
            "--align" => out.align = value().parse().expect("--align BYTES"),
            "--runs" => out.runs = value().parse().expect("--runs N"),
            "--one-manager" => out.one = true,
            "--persistent" => out.persistent = true,
            "--bench" => {}
            other => out.trace = other.to_string(),
        }
    }
    assert!(
        !out.trace.is_empty(),
        "usage: replay TRACE [--page B] [--align B] [--runs N]"
    );
    out
}

fn read(path: &str) -> (usize, Vec<Event>) {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let mut managers = 0;
    let mut events = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let f: Vec<&str> = line.split(' ').collect();
        let num = |i: usize| -> u64 {
            f.get(i)
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{path}:{}: field {i} of {line:?}", n + 1))
        };
        match f[0] {
            "M" => managers = managers.max(num(1) as usize + 1),
            "R" => events.push(Event::Reserve {
                manager: num(1) as usize,
                buffer: num(2),
                size: num(3),
            }),
            "F" => events.push(Event::Free { buffer: num(2) }),
            "P" => events.push(Event::Mode {
                manager: num(1) as usize,
                persistent: num(2) == 1,
            }),
            _ => panic!("{path}:{}: not a trace line: {line:?}", n + 1),
        }
    }
    if let Some(Event::Reserve { manager, .. }) = events
        .iter()
        .find(|e| matches!(e, Event::Reserve { manager, .. } if *manager >= managers))
    {
        panic!("{path}: manager {manager} reserves, but no `M {manager}` line names it");
    }
    (managers, events)
}

fn main() {
    let args = args();
    let (mut managers, mut events) = read(&args.trace);
    if args.one {
        managers = 1;
        for event in &mut events {
            if let Event::Reserve { manager, .. } | Event::Mode { manager, .. } = event {
                *manager = 0;
            }
        }
    }
    let reserves = events
        .iter()
        .filter(|e| matches!(e, Event::Reserve { .. }))
        .count();
    let props = MemoryDeviceProperties {
        max_page_size: args.page,
        alignment: args.align,
    };
    let mut best = f64::INFINITY;
    let mut peak = 0;
    let mut allocs = 0;
    for _ in 0..args.runs {
        let logger = Arc::new(ServerLogger::default());
        let mut mms: Vec<MemoryManagement<Counting>> = (0..managers)
            .map(|i| {
                MemoryManagement::from_configuration(
                    Counting::default(),
                    &props,
                    MemoryConfiguration::default(),
                    logger.clone(),
                    MemoryManagementOptions::new(format!("replay {i}")),
                )
            })
            .collect();
        if args.persistent {
            for mm in &mut mms {
                mm.mode(MemoryAllocationMode::Persistent);
            }
        }
        let mut live: HashMap<u64, SliceHandle> = HashMap::with_capacity(reserves);
        let start = Instant::now();
        for event in &events {
            match *event {
                Event::Reserve {
                    manager,
                    buffer,
                    size,
                } => {
                    let handle = mms[manager].reserve(size).expect("the pool reserves");
                    live.insert(buffer, handle);
                }
                Event::Free { buffer } => {
                    live.remove(&buffer);
                }
                Event::Mode {
                    manager,
                    persistent,
                } => mms[manager].mode(if persistent {
                    MemoryAllocationMode::Persistent
                } else {
                    MemoryAllocationMode::Auto
                }),
            }
        }
        best = best.min(start.elapsed().as_secs_f64());
        // Each manager's own peak, summed (one manager under --one-manager).
        peak = mms.iter_mut().map(|m| m.storage().peak).sum();
        allocs = mms.iter_mut().map(|m| m.storage().allocs).sum();
    }
    println!(
        "{reserves} reservations: best of {} runs {:.1} ms, {:.0} ns each; device memory held at peak {:.1} MiB in {allocs} allocations",
        args.runs,
        best * 1e3,
        best * 1e9 / reserves as f64,
        peak as f64 / (1024.0 * 1024.0),
    );
}
