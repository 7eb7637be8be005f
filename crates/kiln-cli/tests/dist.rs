//! Data parallelism through `kiln launch`, against a single-process run of the same samples, and
//! the launcher's behaviour when a worker dies.

mod kiln_bin;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kiln_bin::kiln_one_thread;
use kiln_testkit::common::{
    free_ports, max_abs_diff, model_weights as weights, tiny_bert_and_tweets as setup, train_args,
};

/// The heart of data parallelism: 2 workers × batch 8 take the same optimizer steps as one process
/// × batch 16 over the same samples (dropout off, fp32), and count the same total_flos.
#[test]
fn two_workers_of_8_equal_one_process_of_16() {
    let Some((tmp, model, tweets)) = setup(false) else {
        return;
    };
    let run = |batch: usize, procs: usize, name: &str| {
        let out = tmp.path().join(name);
        let mut c = kiln_one_thread();
        if procs > 1 {
            let port = free_ports(procs as u16).to_string();
            c.args(["launch", "--nproc-per-node", &procs.to_string()])
                .args(["--master-port", &port, "--timeout", "60", "--"]);
        }
        let st = c
            .args(train_args(&model, &tweets, batch, &out, 4))
            .arg("--pad-to-max-length")
            .status()
            .unwrap();
        assert!(st.success(), "{name} failed");
        let state = std::fs::read_to_string(out.join("trainer_state.json")).unwrap();
        let state: serde_json::Value = serde_json::from_str(&state).unwrap();
        (weights(&out), state["total_flos"].as_f64().unwrap())
    };
    let (single, single_flos) = run(16, 1, "single16");
    let (ddp, ddp_flos) = run(8, 2, "ddp2x8");
    let (half, _) = run(8, 1, "single8");
    // total_flos counts every rank's tokens, as transformers' store_flos sums them.
    assert!(single_flos > 0.0);
    assert!(
        (ddp_flos - single_flos).abs() <= 1e-6 * single_flos,
        "total_flos: 2 workers {ddp_flos}, one process {single_flos}"
    );
    // Two "machines" on loopback: two launchers, one worker each, --nnodes 2.
    let two_nodes = tmp.path().join("two_nodes");
    let port = free_ports(2).to_string();
    let node = |rank: usize| {
        kiln_one_thread()
            .args(["launch", "--nnodes", "2", "--node-rank", &rank.to_string()])
            .args(["--nproc-per-node", "1", "--master-addr", "127.0.0.1"])
            .args(["--master-port", &port, "--timeout", "60", "--"])
            .args(train_args(&model, &tweets, 8, &two_nodes, 4))
            .spawn()
            .unwrap()
    };
    let (mut n0, mut n1) = (node(0), node(1));
    assert!(n0.wait().unwrap().success() && n1.wait().unwrap().success());
    let nodes = weights(&two_nodes);
    let diff = max_abs_diff(&ddp, &single);
    let control = max_abs_diff(&half, &single);
    eprintln!("2x8 vs 1x16: max |Δw| = {diff:e}; 1x8 vs 1x16 (control): {control:e}");
    assert!(diff < 1e-5, "2 workers x 8 differ from 1 x 16 by {diff}");
    let node_diff = max_abs_diff(&nodes, &single);
    eprintln!("2 nodes x 1 x 8 vs 1x16: max |Δw| = {node_diff:e}");
    assert!(
        node_diff < 1e-5,
        "2 nodes differ from 1 x 16 by {node_diff}"
    );
    // The comparison can fail: a different batch really gives different weights.
    assert!(
        control > 1e-4,
        "control run too close ({control}): the test cannot tell"
    );
}

/// torchrun from the reference venv (`$KILN_PYTHON`'s folder, else ~/.cache/kiln-venv), if any.
fn torchrun() -> Option<std::path::PathBuf> {
    let from_python = std::env::var_os("KILN_PYTHON")
        .map(std::path::PathBuf::from)
        .and_then(|p| p.parent().map(|d| d.join("torchrun")));
    let venv = std::env::var_os("HOME")
        .map(|h| std::path::PathBuf::from(h).join(".cache/kiln-venv/bin/torchrun"));
    [from_python, venv]
        .into_iter()
        .flatten()
        .find(|p| p.exists())
}

/// The real torchrun starts kiln workers (`--no-python`): they join (kiln's rendezvous steps
/// aside from the port torchrun's store holds) and take the same steps as under `kiln launch`.
#[test]
fn torchrun_starts_kiln_workers() {
    let Some((tmp, model, tweets)) = setup(false) else {
        return;
    };
    let Some(torchrun) = torchrun() else {
        eprintln!("torchrun_starts_kiln_workers: SKIPPED (no torchrun; run scripts/setup-reference-python)");
        return;
    };
    let launched = tmp.path().join("launched");
    let st = kiln_one_thread()
        .args(["launch", "--standalone", "--nproc-per-node", "2", "--"])
        .args(train_args(&model, &tweets, 8, &launched, 4))
        .status()
        .unwrap();
    assert!(st.success());
    let by_torchrun = tmp.path().join("torchrun");
    let out = Command::new(torchrun)
        .args(["--standalone", "--nproc-per-node", "2", "--no-python"])
        .arg(env!("CARGO_BIN_EXE_kiln"))
        .args(train_args(&model, &tweets, 8, &by_torchrun, 4))
        .env("KILN_LOG", "warn")
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "torchrun failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let d = max_abs_diff(&weights(&by_torchrun), &weights(&launched));
    eprintln!("torchrun vs kiln launch: max |Δw| = {d:e}");
    assert!(
        d <= 1e-6,
        "torchrun's workers differ from kiln launch's by {d}"
    );
}

/// Children of `pid` (Linux /proc).
fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|s| s.parse().ok())
        .collect()
}

/// A worker killed mid-run ends the job: the launcher stops the other worker and exits non-zero,
/// naming the rank, well within the timeout.
#[test]
fn a_killed_worker_stops_the_job_with_an_error() {
    let Some((tmp, model, tweets)) = setup(true) else {
        return;
    };
    let port = free_ports(2);
    let mut launcher = kiln_one_thread()
        .args(["launch", "--nproc-per-node", "2", "--master-port"])
        .arg(port.to_string())
        .args(["--timeout", "20", "--"])
        .args(train_args(
            &model,
            &tweets,
            4,
            &tmp.path().join("run"),
            100_000,
        ))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Let the workers start training, then kill one of them.
    let t0 = Instant::now();
    let workers = loop {
        let w = children(launcher.id());
        if w.len() == 2 || t0.elapsed() > Duration::from_secs(30) {
            break w;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(workers.len(), 2, "launcher did not start 2 workers");
    // Once the job is up, the rendezvous and both tensor services listen on the given address
    // (loopback) only, never on every interface. Waited for, not slept: a loaded machine is slow.
    let listening = loop {
        let l = listeners(port..=port + 2);
        if l.len() >= 3 || t0.elapsed() > Duration::from_secs(120) {
            break l;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    std::thread::sleep(Duration::from_secs(1));
    let victim = workers[1];
    // SAFETY: signals a worker process this test's launcher started.
    unsafe { libc_kill(victim as i32, 9) };
    let killed_at = Instant::now();
    let status = loop {
        if let Some(s) = launcher.try_wait().unwrap() {
            break s;
        }
        assert!(
            killed_at.elapsed() < Duration::from_secs(60),
            "launcher still running 60 s after a worker died"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut err = String::new();
    use std::io::Read;
    launcher
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(!status.success());
    assert!(
        err.contains("error: worker rank"),
        "no rank named in: {err}"
    );
    let ports: Vec<u16> = listening.iter().map(|(_, p)| *p).collect();
    assert_eq!(
        ports,
        [port, port + 1, port + 2],
        "listeners: {listening:?}"
    );
    assert!(
        listening.iter().all(|(ip, _)| ip == "127.0.0.1"),
        "a job on loopback listened elsewhere: {listening:?}"
    );
    eprintln!(
        "launcher exited {:?} after {:?}",
        status.code(),
        killed_at.elapsed()
    );
}

/// Listening TCP sockets on `ports` (Linux /proc/net/tcp and tcp6), as (address, port), by port.
fn listeners(ports: std::ops::RangeInclusive<u16>) -> Vec<(String, u16)> {
    let mut out = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let text = std::fs::read_to_string(table).unwrap_or_default();
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            let (Some(local), Some(&"0A")) = (cols.get(1), cols.get(3)) else {
                continue; // 0A: LISTEN
            };
            let (ip, port) = local.split_once(':').unwrap();
            let port = u16::from_str_radix(port, 16).unwrap();
            if !ports.contains(&port) {
                continue;
            }
            // IPv4 is one little-endian word; anything in tcp6 is shown as its hex.
            let ip = match u32::from_str_radix(ip, 16) {
                Ok(v) if ip.len() == 8 => std::net::Ipv4Addr::from(v.swap_bytes()).to_string(),
                _ => ip.to_string(),
            };
            out.push((ip, port));
        }
    }
    out.sort_by_key(|(_, p)| *p);
    out
}

/// Runs a launch that must fail: it exits non-zero within `within`, and stderr says `expected`.
fn launch_fails(args: &[&str], worker: Vec<String>, expected: &str, within: Duration) {
    let t0 = Instant::now();
    let out = kiln_one_thread()
        .arg("launch")
        .args(args)
        .arg("--")
        .args(worker)
        .output()
        .unwrap();
    let took = t0.elapsed();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "launch {args:?} succeeded");
    assert!(
        err.contains(expected),
        "launch {args:?}: no {expected:?} in: {err}"
    );
    assert!(took < within, "launch {args:?} took {took:?}");
}

/// Wrong set-ups fail fast with an error that says what to change.
#[test]
fn launch_setup_errors_are_clear() {
    let Some((tmp, model, tweets)) = setup(false) else {
        return;
    };
    let worker = || train_args(&model, &tweets, 8, &tmp.path().join("run"), 4);
    let ports: Vec<String> = (0..4).map(|_| free_ports(3).to_string()).collect();
    let port = |i: usize| ports[i].as_str();
    // The rendezvous port is taken.
    let taken =
        std::net::TcpListener::bind(("127.0.0.1", ports[0].parse::<u16>().unwrap())).unwrap();
    launch_fails(
        &["--nproc-per-node", "2", "--master-port", port(0)],
        worker(),
        "pick another --master-port",
        Duration::from_secs(10),
    );
    drop(taken);
    // Node 0 must be MASTER_ADDR's machine (192.0.2.1 is a documentation address).
    launch_fails(
        &[
            "--nproc-per-node",
            "2",
            "--master-addr",
            "192.0.2.1",
            "--master-port",
            port(1),
        ],
        worker(),
        "must be an address of this machine",
        Duration::from_secs(10),
    );
    // No node 0 answers: node 1's worker gives up after --timeout, naming the rendezvous.
    launch_fails(
        &[
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--nproc-per-node",
            "1",
            "--master-port",
            port(2),
            "--timeout",
            "3",
        ],
        worker(),
        &format!(
            "rendezvous at 127.0.0.1:{} did not complete within 3s",
            port(2)
        ),
        Duration::from_secs(30),
    );
    // Node 0 thinks the job has 2 workers, node 1 thinks 3: node 1 is told so by rank 0's
    // heartbeat as soon as both run, however loaded the machine is. The timeouts are long so that
    // only the mismatch itself can end the job (a rendezvous timeout would be a failure).
    let node0 = kiln_one_thread()
        .args([
            "launch",
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--nproc-per-node",
            "1",
        ])
        .args(["--master-port", port(3), "--timeout", "120", "--"])
        .args(worker())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(1));
    launch_fails(
        &[
            "--nnodes",
            "3",
            "--node-rank",
            "1",
            "--nproc-per-node",
            "1",
            "--master-port",
            port(3),
            "--timeout",
            "120",
        ],
        worker(),
        // Rank 0's heartbeat answer or Burn's registration, whichever comes first, says it.
        "than this one's 3",
        Duration::from_secs(110),
    );
    let node0 = node0.wait_with_output().unwrap();
    assert!(!node0.status.success(), "node 0 of a broken job succeeded");
}

extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

/// A checkpoint written by one process resumes under two workers (same global batch) and ends
/// where the uninterrupted single-process run ends.
#[test]
fn a_single_process_checkpoint_resumes_on_two_workers() {
    let Some((tmp, model, tweets)) = setup(false) else {
        return;
    };
    let full = tmp.path().join("full");
    let mut args = train_args(&model, &tweets, 16, &full, 4);
    let save = args.iter().position(|a| a == "--save-strategy").unwrap();
    args[save + 1] = "steps".into();
    args.extend(["--save-steps".into(), "2".into()]);
    assert!(kiln_one_thread().args(&args).status().unwrap().success());
    let resumed = tmp.path().join("resumed");
    let st = kiln_one_thread()
        .args(["launch", "--nproc-per-node", "2", "--master-port"])
        .arg(free_ports(2).to_string())
        .args(["--timeout", "60", "--"])
        .args(train_args(&model, &tweets, 8, &resumed, 4))
        .arg("--resume-from-checkpoint")
        .arg(full.join("checkpoint-2"))
        .status()
        .unwrap();
    assert!(st.success());
    let diff = max_abs_diff(&weights(&resumed), &weights(&full));
    eprintln!("1x16 to step 2, then 2x8 to step 4, vs 1x16 to step 4: max |Δw| = {diff:e}");
    assert!(diff < 1e-5, "resumed on 2 workers differs by {diff}");
    // ... and it really trained steps 3 and 4 rather than stopping at the checkpoint.
    let moved = max_abs_diff(&weights(&resumed), &weights(&full.join("checkpoint-2")));
    assert!(
        moved > 1e-4,
        "resumed run did not move from the checkpoint ({moved})"
    );
}

/// The worker of `launcher` whose environment says `RANK=rank`.
fn worker_of_rank(launcher: u32, rank: usize) -> Option<u32> {
    children(launcher).into_iter().find(|pid| {
        std::fs::read(format!("/proc/{pid}/environ"))
            .unwrap_or_default()
            .split(|b| *b == 0)
            .any(|kv| kv == format!("RANK={rank}").as_bytes())
    })
}

/// `--max-restarts 1` (torchrun's elastic restart): a worker killed mid-run stops the job, every
/// worker starts again from the run's latest checkpoint, and the run ends with the weights of an
/// undisturbed run. The command is given without `--`, as torchrun takes it.
#[test]
fn a_restarted_job_ends_where_an_undisturbed_one_does() {
    let Some((tmp, model, tweets)) = setup(false) else {
        return;
    };
    let steps = 200;
    let args = |out: &std::path::Path| {
        let mut a = train_args(&model, &tweets, 8, out, steps);
        let save = a.iter().position(|a| a == "--save-strategy").unwrap();
        a[save + 1] = "steps".into();
        a.extend(["--save-steps".into(), "20".into()]);
        a
    };
    let undisturbed = tmp.path().join("undisturbed");
    let st = kiln_one_thread()
        .args(["launch", "--nproc-per-node", "2", "--master-port"])
        .arg(free_ports(2).to_string())
        .arg("--")
        .args(args(&undisturbed))
        .status()
        .unwrap();
    assert!(st.success());

    let restarted = tmp.path().join("restarted");
    let logs = tmp.path().join("logs");
    let mut launcher = kiln_one_thread()
        .env("KILN_LOG", "info")
        .args(["launch", "--nproc-per-node", "2", "--max-restarts", "1"])
        .args(["--rdzv-id", "job7", "--log-dir"])
        .arg(&logs)
        .args(["--master-port", &free_ports(2).to_string()])
        .args(args(&restarted))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let err = std::thread::spawn({
        let mut stderr = launcher.stderr.take().unwrap();
        move || {
            let mut s = String::new();
            std::io::Read::read_to_string(&mut stderr, &mut s).unwrap();
            s
        }
    });
    // Kill rank 1 once the first checkpoint is complete (its marker is written last).
    let t0 = Instant::now();
    let first = restarted.join("checkpoint-20").join("kiln_checkpoint.json");
    while !first.exists() {
        assert!(
            t0.elapsed() < Duration::from_secs(300),
            "no checkpoint after 300 s"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let victim = worker_of_rank(launcher.id(), 1).expect("rank 1 is running");
    // SAFETY: signals a worker process this test's launcher started.
    unsafe { libc_kill(victim as i32, 9) };
    let status = launcher.wait().unwrap();
    let err = err.join().unwrap();
    assert!(status.success(), "the restarted job failed: {err}");
    assert!(
        err.contains("worker rank 1 was killed by signal 9")
            && err.contains("restarting every worker in 0.5 s (restart 1 of 1)"),
        "no restart reported: {err}"
    );
    let from: u64 = err
        .split("restart 1: resuming from ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|p| p.rsplit("checkpoint-").next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("the restart did not resume a checkpoint: {err}"));
    assert!(
        (20..steps as u64).contains(&from),
        "resumed from step {from}"
    );
    let diff = max_abs_diff(&weights(&restarted), &weights(&undisturbed));
    eprintln!("killed at checkpoint 20, restarted from checkpoint-{from}: max |Δw| vs undisturbed = {diff:e}");
    assert!(diff < 1e-5, "the restarted run differs by {diff}");
    // It trained on after the restart rather than stopping at the checkpoint it resumed.
    let ckpt = restarted.join(format!("checkpoint-{from}"));
    assert!(max_abs_diff(&weights(&restarted), &weights(&ckpt)) > 1e-4);
    // --log-dir keeps each attempt's output, per local rank.
    for attempt in ["attempt_0", "attempt_1"] {
        for rank in ["0", "1"] {
            let f = logs
                .join("job7")
                .join(attempt)
                .join(rank)
                .join("stderr.log");
            assert!(f.exists(), "{} missing", f.display());
        }
    }
}

/// A worker that always fails is restarted after 0.5 s, then 1 s, ... (it used to be restarted 23
/// times a second), and a job id that would leave `--log-dir` is refused before anything starts.
#[test]
fn restarts_back_off_and_job_ids_stay_inside_the_log_dir() {
    let tmp = tempfile::tempdir().unwrap();
    let logs = tmp.path().join("logs");
    let t0 = Instant::now();
    let out = kiln_one_thread()
        .env("KILN_LOG", "warn")
        .args(["launch", "--nproc-per-node", "1", "--max-restarts", "2"])
        .args(["--master-port", &free_ports(1).to_string(), "--log-dir"])
        .arg(&logs)
        .args(["--", "train", "--no-such-option"])
        .output()
        .unwrap();
    let elapsed = t0.elapsed();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("restarting every worker in 0.5 s (restart 1 of 2)")
            && err.contains("restarting every worker in 1.0 s (restart 2 of 2)")
            && err.contains("(after 2 restart(s) of 2)"),
        "{err}"
    );
    assert!(elapsed >= Duration::from_millis(1500), "{elapsed:?}");

    for id in ["../..", "/tmp", "a/b", ".."] {
        let out = kiln_one_thread()
            .args([
                "launch",
                "--nproc-per-node",
                "1",
                "--rdzv-id",
                id,
                "--log-dir",
            ])
            .arg(&logs)
            .args(["--", "train", "--no-such-option"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{id}: {err}");
        assert!(
            err.contains(&format!("--rdzv-id {id:?}: a job id names its folder")),
            "{id}: {err}"
        );
    }
    // Only the first job's folder is under --log-dir, and nothing beside it.
    let made: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().flatten().collect();
    assert_eq!(made.len(), 1, "{made:?}");
}

/// A launcher killed outright (SIGKILL: nothing of it runs after) takes its workers with it,
/// rather than leaving them training as orphans.
#[test]
fn workers_of_a_killed_launcher_stop() {
    let Some((tmp, model, tweets)) = setup(false) else {
        return;
    };
    let out = tmp.path().join("orphans");
    let mut launcher = kiln_one_thread()
        .args(["launch", "--nproc-per-node", "2", "--master-port"])
        .arg(free_ports(2).to_string())
        .arg("--")
        .args(train_args(&model, &tweets, 8, &out, 100_000))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let workers = loop {
        let w: Vec<u32> = (0..2)
            .filter_map(|r| worker_of_rank(launcher.id(), r))
            .collect();
        if w.len() == 2 {
            break w;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "no workers");
        std::thread::sleep(Duration::from_millis(20));
    };
    launcher.kill().unwrap();
    launcher.wait().unwrap();
    let t1 = Instant::now();
    while workers
        .iter()
        .any(|pid| std::path::Path::new(&format!("/proc/{pid}")).exists() && !zombie(*pid))
    {
        assert!(
            t1.elapsed() < Duration::from_secs(30),
            "workers {workers:?} still run after their launcher was killed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Whether process `pid` has exited but was not reaped yet.
fn zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rfind(')').map(|i| s[i + 2..].starts_with('Z')))
        .unwrap_or(true)
}
