//! kiln's patch (PATCHES.md): `KILN_GPU_MEMORY_TRACE` writes the reservations and the frees the
//! pools see, in the format `benches/replay.rs` reads. Its own test binary: the variable is read
//! once per process, when the first memory manager is made.

use cubecl_ir::MemoryDeviceProperties;
use cubecl_runtime::{
    logging::ServerLogger,
    memory_management::{
        MemoryAllocationMode, MemoryConfiguration, MemoryManagement, MemoryManagementOptions,
    },
    storage::BytesStorage,
};
use std::sync::Arc;

#[test]
fn the_trace_holds_each_reservation_and_each_free_in_the_order_the_pools_see_them() {
    let path = std::env::temp_dir().join(format!("kiln-memory-trace-{}", std::process::id()));
    // SAFETY: the only test of this binary, before any thread reads the environment.
    unsafe { std::env::set_var("KILN_GPU_MEMORY_TRACE", &path) };
    let props = MemoryDeviceProperties {
        max_page_size: 1 << 20,
        alignment: 32,
    };
    let mut mm = MemoryManagement::from_configuration(
        BytesStorage::default(),
        &props,
        MemoryConfiguration::default(),
        Arc::new(ServerLogger::default()),
        MemoryManagementOptions::new("Main GPU Memory"),
    );
    let a = mm.reserve(100).unwrap();
    let b = mm.reserve(200).unwrap();
    drop(a);
    // Freed, but no pool has looked yet: the free is written when the next reservation finds it.
    mm.mode(MemoryAllocationMode::Persistent);
    let c = mm.reserve(300).unwrap();
    drop((b, c));

    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).ok();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines,
        [
            "M 0 MainGPUMemory 1048576 32",
            "R 0 0 100",
            "R 0 1 200",
            "P 0 1",
            "F 0 0",
            "R 0 2 300",
        ]
    );
}
