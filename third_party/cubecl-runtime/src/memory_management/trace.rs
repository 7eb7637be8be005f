//! kiln's patch (PATCHES.md): `KILN_GPU_MEMORY_TRACE=FILE` writes every reservation a memory
//! manager is asked for, and every buffer found freed, to FILE, so a step's allocations can be
//! replayed against a pool without the GPU (`benches/replay.rs`).
//!
//! A pool only learns that a buffer is free when it next looks (a buffer is free once every
//! handle to it is dropped), so frees are written as each reservation finds them: the order of
//! events is the order the pools see. Lines:
//! `M <manager> <name> <max_page_size> <alignment>`, `F <manager> <buffer>`,
//! `R <manager> <buffer> <size>`, and `P <manager> 0|1` when the allocation mode changes (1:
//! persistent).

use crate::memory_management::SliceHandle;
use alloc::string::String;
use alloc::sync::Weak;
use alloc::vec::Vec;
use std::io::Write;
use std::sync::{Mutex, OnceLock};

struct Sink {
    out: std::io::BufWriter<std::fs::File>,
    managers: usize,
    buffers: u64,
}

fn sink() -> Option<&'static Mutex<Sink>> {
    static SINK: OnceLock<Option<Mutex<Sink>>> = OnceLock::new();
    SINK.get_or_init(|| {
        let path = std::env::var_os("KILN_GPU_MEMORY_TRACE")?;
        let file = std::fs::File::create(&path)
            .unwrap_or_else(|e| panic!("KILN_GPU_MEMORY_TRACE={path:?}: {e}"));
        Some(Mutex::new(Sink {
            out: std::io::BufWriter::new(file),
            managers: 0,
            buffers: 0,
        }))
    })
    .as_ref()
}

/// One memory manager's side of the trace.
pub(crate) struct Trace {
    manager: usize,
    live: Vec<(u64, Weak<()>)>,
}

impl Trace {
    /// `None` unless `KILN_GPU_MEMORY_TRACE` is set.
    pub(crate) fn new(name: &str, max_page_size: u64, alignment: u64) -> Option<Self> {
        let mut sink = sink()?.lock().unwrap();
        let manager = sink.managers;
        sink.managers += 1;
        let name: String = name.chars().filter(|c| !c.is_whitespace()).collect();
        writeln!(sink.out, "M {manager} {name} {max_page_size} {alignment}").unwrap();
        Some(Self {
            manager,
            live: Vec::new(),
        })
    }

    /// Writes the buffers freed since the last reservation.
    pub(crate) fn frees(&mut self) {
        let mut sink = sink().unwrap().lock().unwrap();
        let manager = self.manager;
        self.live.retain(|(buffer, watch)| {
            // The pool's own copy of the handle is the one left when a buffer is free.
            let free = watch.strong_count() <= 1;
            if free {
                writeln!(sink.out, "F {manager} {buffer}").unwrap();
            }
            !free
        });
    }

    /// Burn allocates parameters in the persistent mode, the rest in the automatic one.
    pub(crate) fn mode(&mut self, persistent: bool) {
        let mut sink = sink().unwrap().lock().unwrap();
        writeln!(sink.out, "P {} {}", self.manager, u8::from(persistent)).unwrap();
    }

    pub(crate) fn reserved(&mut self, size: u64, handle: &SliceHandle) {
        let mut sink = sink().unwrap().lock().unwrap();
        let buffer = sink.buffers;
        sink.buffers += 1;
        writeln!(sink.out, "R {} {buffer} {size}", self.manager).unwrap();
        sink.out.flush().ok();
        self.live.push((buffer, handle.watch()));
    }
}
