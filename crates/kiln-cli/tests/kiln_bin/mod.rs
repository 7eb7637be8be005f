//! How the tests here start the `kiln` binary they were built with (`mod kiln_bin;` in each test
//! file). The other helpers, shared with the library's tests, are the `kiln-testkit` crate's.
#![allow(dead_code)]

use std::process::Command;

/// The `kiln` binary, logging warnings and errors only (`KILN_LOG=warn`): a test reads its results
/// and its one-sentence errors, not its progress lines. A test adds its own variables, or
/// overrides this one, on the returned command.
pub fn kiln() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kiln"));
    c.env("KILN_LOG", "warn");
    c
}

/// [`kiln`] on one CPU worker thread (`RAYON_NUM_THREADS=1`): for tests that run several
/// processes at once (launched workers, a job beside `kiln top`) or measure one.
pub fn kiln_one_thread() -> Command {
    let mut c = kiln();
    c.env("RAYON_NUM_THREADS", "1");
    c
}

/// `kiln` under `kiln launch` with `procs` processes (alone when 1), before its command, each on
/// one CPU thread.
pub fn launched(procs: usize) -> Command {
    let mut c = kiln_one_thread();
    if procs > 1 {
        c.args(["launch", "--nproc-per-node", &procs.to_string()])
            .args([
                "--master-port",
                &kiln_testkit::common::free_ports(procs as u16).to_string(),
            ])
            .args(["--timeout", "60", "--"]);
    }
    c
}
