//! `kiln top` and `kiln plot` against files another user (or a broken job) leaves behind: a
//! runtime folder that is a symbolic link or someone else's, job entries that are not kiln's, rank
//! files that are FIFOs or `/dev/zero`, text that carries terminal escape sequences, a 50 MB log
//! and a log with 20,000 metric names. Each case failed before its fix (issue 31).

mod kiln_bin;

use std::io::{BufWriter, Write};
use std::os::unix::fs::{symlink, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use kiln_bin::kiln_one_thread;

/// Runs `cmd` (its output into files, so a large output cannot block it) and fails the test if it
/// has not finished within `limit`: the cases here used to hang or take minutes.
fn output_within(cmd: &mut Command, limit: Duration, what: &str) -> Output {
    let tmp = tempfile::tempdir().unwrap();
    let (out, err) = (tmp.path().join("out"), tmp.path().join("err"));
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{what}: still running after {limit:?}; stderr so far: {}",
                String::from_utf8_lossy(&std::fs::read(&err).unwrap())
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Output {
        status,
        stdout: std::fs::read(&out).unwrap(),
        stderr: std::fs::read(&err).unwrap(),
    }
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// A rank state as a running rank publishes it, on host `host`.
fn write_rank(out: &Path, rank: usize, host: &str) {
    let live = out.join("live");
    std::fs::create_dir_all(&live).unwrap();
    let t = now();
    let state = serde_json::json!({
        "rank": rank, "world_size": 4, "pid": 1, "host": host, "phase": "training",
        "step": 3, "total_steps": 10, "started_unix": t, "heartbeat_unix": t, "last_step_unix": t,
        "loss": 0.5, "loss_history": [0.9, 0.7, 0.5],
    });
    std::fs::write(live.join(format!("rank-{rank}.json")), state.to_string()).unwrap();
}

fn mkfifo(path: &Path) {
    let ok = Command::new("mkfifo").arg(path).status().unwrap().success();
    assert!(ok, "mkfifo {}", path.display());
}

/// A private runtime folder, as kiln creates it.
fn private_dir(path: &Path) -> PathBuf {
    std::fs::create_dir_all(path).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700)).unwrap();
    path.to_path_buf()
}

/// A job entry as a running rank registers it.
fn job_entry(output_dir: &Path, pid: u32) -> String {
    serde_json::json!({"output_dir": output_dir.display().to_string(), "rank": 0, "pid": pid})
        .to_string()
}

/// A pid no process has (above Linux's largest pid_max).
const DEAD_PID: u32 = 999_999_999;

#[test]
fn top_refuses_a_runtime_folder_that_is_a_symlink_and_deletes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    // Another user points the runtime folder at our files.
    let victim = tmp.path().join("victim");
    std::fs::create_dir_all(victim.join("jobs")).unwrap();
    std::fs::write(victim.join("jobs/precious.txt"), "my thesis").unwrap();
    std::fs::write(
        victim.join(format!("jobs/{DEAD_PID}.json")),
        job_entry(tmp.path(), DEAD_PID),
    )
    .unwrap();
    let runtime = tmp.path().join("kiln-rt");
    symlink(&victim, &runtime).unwrap();
    let o = output_within(
        kiln_one_thread()
            .env("KILN_RUNTIME_DIR", &runtime)
            .args(["top", "--once"]),
        Duration::from_secs(60),
        "kiln top --once",
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&runtime.display().to_string()) && err.contains("symbolic link"),
        "one sentence naming the folder: {err}"
    );
    assert_eq!(
        std::fs::read_to_string(victim.join("jobs/precious.txt")).unwrap(),
        "my thesis"
    );
    assert!(
        victim.join(format!("jobs/{DEAD_PID}.json")).exists(),
        "nothing is deleted through a symbolic link"
    );
}

#[test]
fn top_refuses_a_runtime_folder_owned_by_someone_else() {
    // Only root can give a folder away; elsewhere this case cannot be set up.
    // SAFETY: getuid has no preconditions.
    if unsafe { libc::getuid() } != 0 {
        eprintln!("skipping: needs root to chown a folder");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let runtime = private_dir(&tmp.path().join("kiln-rt"));
    let jobs = private_dir(&runtime.join("jobs"));
    std::fs::write(jobs.join("notes.txt"), "theirs").unwrap();
    let c = std::ffi::CString::new(runtime.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::chown(c.as_ptr(), 65534, 65534) }, 0);
    let o = output_within(
        kiln_one_thread()
            .env("KILN_RUNTIME_DIR", &runtime)
            .args(["top", "--once"]),
        Duration::from_secs(60),
        "kiln top --once",
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&runtime.display().to_string()) && err.contains("owned by"),
        "{err}"
    );
    assert!(jobs.join("notes.txt").exists());
}

#[test]
fn stale_cleanup_removes_only_kiln_job_entries_and_follows_no_symlink() {
    let tmp = tempfile::tempdir().unwrap();
    let runtime = private_dir(&tmp.path().join("kiln-rt"));
    let jobs = private_dir(&runtime.join("jobs"));
    // A live job (this test's own pid) with one rank.
    let run = tmp.path().join("run");
    write_rank(&run, 0, "node-a");
    let me = std::process::id();
    std::fs::write(jobs.join(format!("{me}.json")), job_entry(&run, me)).unwrap();
    // A stale entry of kiln's own: the only file that goes.
    let stale = jobs.join(format!("{DEAD_PID}.json"));
    std::fs::write(&stale, job_entry(&run, DEAD_PID)).unwrap();
    // Everything else stays: other files, a look-alike name that is not an entry, an entry whose
    // name is not its pid, a symlink, a folder and a FIFO (which must not block either).
    let outside = tmp.path().join("outside.txt");
    std::fs::write(&outside, job_entry(&run, DEAD_PID)).unwrap();
    let keep = [
        ("notes.txt", Some("hello".to_string())),
        ("12345.json", Some("not json".to_string())),
        ("777.json", Some(job_entry(&run, DEAD_PID))),
        ("readme.json", Some(job_entry(&run, DEAD_PID))),
    ];
    for (name, text) in &keep {
        std::fs::write(jobs.join(name), text.as_deref().unwrap()).unwrap();
    }
    symlink(&outside, jobs.join("888888888.json")).unwrap();
    std::fs::create_dir(jobs.join("555555555.json")).unwrap();
    mkfifo(&jobs.join("444444444.json"));

    let o = output_within(
        kiln_one_thread()
            .env("KILN_RUNTIME_DIR", &runtime)
            .args(["top", "--once"]),
        Duration::from_secs(60),
        "kiln top --once with a FIFO among the job entries",
    );
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(o.status.success(), "{err}");
    assert!(
        out.contains(&run.display().to_string()),
        "the live job: {out}"
    );
    assert!(!stale.exists(), "a dead job's entry is cleaned up");
    for (name, _) in &keep {
        assert!(jobs.join(name).exists(), "{name} was deleted");
    }
    for name in ["888888888.json", "555555555.json", "444444444.json"] {
        assert!(
            std::fs::symlink_metadata(jobs.join(name)).is_ok(),
            "{name} was deleted"
        );
    }
    assert!(outside.exists(), "a symlink's target is never touched");
    assert!(jobs.join(format!("{me}.json")).exists());
}

#[test]
fn top_creates_no_runtime_folder() {
    // Only a training job creates the runtime folder (0700: the library's tests check that);
    // `kiln top` only reads, and a folder that is not there means no job.
    let tmp = tempfile::tempdir().unwrap();
    let runtime = tmp.path().join("absent/kiln");
    let o = output_within(
        kiln_one_thread()
            .env("KILN_RUNTIME_DIR", &runtime)
            .args(["top", "--once"]),
        Duration::from_secs(60),
        "kiln top --once",
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1));
    assert!(err.contains("no kiln training job is running"), "{err}");
    assert!(!runtime.exists(), "reading creates nothing");
}

#[test]
fn a_fifo_and_dev_zero_as_rank_files_are_skipped_promptly() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    write_rank(&run, 0, "node-a");
    mkfifo(&run.join("live/rank-1.json"));
    symlink("/dev/zero", run.join("live/rank-2.json")).unwrap();
    for json in [false, true] {
        let mut cmd = kiln_one_thread();
        cmd.args(["top", "--once"]);
        if json {
            cmd.arg("--json");
        }
        let o = output_within(
            cmd.arg(&run),
            Duration::from_secs(60),
            "kiln top --once on a FIFO and /dev/zero",
        );
        let (out, err) = (
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr),
        );
        assert!(o.status.success(), "{err}");
        assert!(out.contains("node-a"), "rank 0 is still shown: {out}");
        for bad in ["rank-1.json", "rank-2.json"] {
            let lines: Vec<&str> = err.lines().filter(|l| l.contains(bad)).collect();
            assert_eq!(lines.len(), 1, "{bad} reported in one line: {err}");
            assert!(lines[0].contains("skipped"), "{err}");
        }
    }
}

#[test]
fn text_from_rank_files_and_folder_names_cannot_drive_the_terminal() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run\x1b]0;pwned\x07");
    write_rank(&run, 0, "evil\x1b]0;pwned\x07\x1b[2J\u{202e}host");
    std::fs::write(run.join("live/rank-\x1b[31m.json"), "{ not a rank").unwrap();
    let runtime = private_dir(&tmp.path().join("kiln-rt"));
    let jobs = private_dir(&runtime.join("jobs"));
    let me = std::process::id();
    std::fs::write(jobs.join(format!("{me}.json")), job_entry(&run, me)).unwrap();
    for args in [
        vec!["top", "--once"],
        vec!["top", "--once", "--json"],
        vec!["top", "--once", run.to_str().unwrap()],
    ] {
        let o = output_within(
            kiln_one_thread()
                .env("KILN_RUNTIME_DIR", &runtime)
                .args(&args),
            Duration::from_secs(60),
            "kiln top --once",
        );
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let all = [o.stdout.as_slice(), o.stderr.as_slice()].concat();
        assert!(
            !all.contains(&0x1b) && !all.contains(&0x07),
            "{args:?}: raw control characters reach the terminal: {:?}",
            String::from_utf8_lossy(&all)
        );
        assert!(
            !String::from_utf8_lossy(&all).contains('\u{202e}'),
            "a bidi override"
        );
        assert!(
            String::from_utf8_lossy(&o.stdout).contains("evil"),
            "the host is still shown, escaped"
        );
    }
}

/// Writes a kiln log of about `bytes`: a train line every step and an eval line every 1,000.
fn big_log(path: &Path, bytes: u64) -> u64 {
    let mut w = BufWriter::new(std::fs::File::create(path).unwrap());
    let (mut written, mut step) = (0u64, 0u64);
    while written < bytes {
        step += 1;
        let loss = 2.0 / (1.0 + step as f64 / 1000.0) + ((step * 7919) % 100) as f64 * 1e-4;
        let line = format!(
            "{{\"loss\":{loss},\"grad_norm\":{},\"learning_rate\":{},\"epoch\":{},\"step\":{step}}}\n",
            1.0 + (step % 13) as f64 / 10.0,
            5e-5 * (1.0 - step as f64 / 2e6),
            step as f64 / 1e4,
        );
        w.write_all(line.as_bytes()).unwrap();
        written += line.len() as u64;
        if step.is_multiple_of(1000) {
            let eval = format!(
                "{{\"eval_loss\":{},\"eval_accuracy\":0.8,\"eval_runtime\":1.5,\"step\":{step},\"epoch\":{}}}\n",
                loss * 1.1,
                step as f64 / 1e4
            );
            w.write_all(eval.as_bytes()).unwrap();
            written += eval.len() as u64;
        }
    }
    w.flush().unwrap();
    step
}

/// Runs `cmd` to its end and returns its output and its peak resident memory in bytes, from the
/// kernel's own account of that one child (wait4), not from timing or sampling.
fn peak_rss(cmd: &mut Command) -> (std::process::ExitStatus, Vec<u8>, u64) {
    let tmp = tempfile::tempdir().unwrap();
    let err = tmp.path().join("err");
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: zeroed rusage is a valid value; wait4 fills it for this child only.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: pid is our own child, not yet waited for; the pointers are valid.
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(r, pid);
    std::mem::forget(child);
    use std::os::unix::process::ExitStatusExt;
    (
        std::process::ExitStatus::from_raw(status),
        std::fs::read(&err).unwrap(),
        usage.ru_maxrss as u64 * 1024,
    )
}

#[test]
fn a_50_mb_log_is_plotted_with_bounded_memory() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("big-run");
    std::fs::create_dir_all(&run).unwrap();
    let log = run.join("log.jsonl");
    let last_step = big_log(&log, 50 << 20);
    let size = std::fs::metadata(&log).unwrap().len();
    let png = tmp.path().join("curves.png");
    let (status, err, peak) = peak_rss(
        kiln_one_thread()
            .arg("plot")
            .arg(&run)
            .arg("--out")
            .arg(&png),
    );
    let err = String::from_utf8_lossy(&err);
    assert!(status.success(), "{err}");
    assert!(png.is_file());
    eprintln!(
        "kiln plot of a {} MB log ({last_step} steps): peak RSS {} MB",
        size >> 20,
        peak >> 20
    );
    // Reading the whole file and every entry as a JSON map took 17x the log (850 MB here); a
    // streamed read keeps a few thousand points per curve, whatever the log's length.
    assert!(
        peak < 200 << 20,
        "peak RSS {} MB for a {} MB log",
        peak >> 20,
        size >> 20
    );
}

#[test]
fn twenty_thousand_metric_names_plot_the_first_panels_and_say_so() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("wide-run");
    std::fs::create_dir_all(&run).unwrap();
    let mut eval = serde_json::Map::new();
    for i in 0..20_000 {
        eval.insert(
            format!("eval_m{i:05}"),
            serde_json::json!(i as f64 / 20_000.0),
        );
    }
    eval.insert("step".into(), serde_json::json!(2));
    let log = format!(
        "{}\n{}\n{}\n",
        r#"{"loss":1.0,"learning_rate":1e-4,"step":1}"#,
        r#"{"loss":0.8,"learning_rate":1e-4,"step":2}"#,
        serde_json::Value::Object(eval)
    );
    std::fs::write(run.join("log.jsonl"), log).unwrap();
    let png = tmp.path().join("curves.png");
    let o = output_within(
        kiln_one_thread()
            .arg("plot")
            .arg(&run)
            .arg("--out")
            .arg(&png),
        Duration::from_secs(120),
        "kiln plot with 20,000 metric names",
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(png.is_file());
    // Loss and learning rate, then the first 62 metrics in name order: 19,938 left out.
    let notes: Vec<&str> = err.lines().filter(|l| l.contains("19938")).collect();
    assert_eq!(notes.len(), 1, "one line says what was left out: {err}");
    assert!(
        notes[0].contains("eval_m00062"),
        "the first left out: {err}"
    );
    let file = std::fs::metadata(&png).unwrap();
    assert!(file.size() > 0);
}
