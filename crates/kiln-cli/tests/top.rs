//! `kiln top` against a real 2-process job: the screen (in a pseudo-terminal, read back through a
//! terminal emulator) shows both ranks with advancing steps, `--once --json` gives the same
//! figures to scripts, and killed ranks are shown as such.

mod kiln_bin;

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kiln_bin::kiln_one_thread;
use kiln_testkit::common::{free_ports, tiny_bert_and_tweets, train_args};
use portable_pty::{native_pty_system, CommandBuilder, PtySize};
use serde_json::Value;

/// `kiln top --once --json` for `out`, parsed.
fn snapshot(out: &Path) -> Value {
    let o = kiln_one_thread()
        .args(["top", "--once", "--json"])
        .arg(out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// Waits until `ok` holds for a snapshot (a live job), or fails after `limit`.
fn wait_for(out: &Path, limit: Duration, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
    let start = Instant::now();
    loop {
        if out.join("live").is_dir() {
            let s = snapshot(out);
            if ok(&s) {
                return s;
            }
            if start.elapsed() > limit {
                panic!("{what}: not within {limit:?}; last snapshot {s}");
            }
        } else if start.elapsed() > limit {
            panic!("{what}: no live state within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn steps(s: &Value) -> Vec<u64> {
    s["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["step"].as_u64().unwrap())
        .collect()
}

/// The step shown on the screen row of `rank` (the table's `step/total` column).
fn screen_step(screen: &str, rank: usize, total: u64) -> Option<u64> {
    screen.lines().find_map(|l| {
        let cols: Vec<&str> = l
            .split(|c: char| c.is_whitespace() || c == '│')
            .filter(|c| !c.is_empty())
            .collect();
        if cols.first() != Some(&rank.to_string().as_str()) {
            return None;
        }
        let suffix = format!("/{total}");
        cols.iter()
            .find_map(|c| c.strip_suffix(suffix.as_str())?.parse().ok())
    })
}

struct Job {
    launcher: Child,
}

impl Drop for Job {
    fn drop(&mut self) {
        let _ = self.launcher.kill();
        let _ = self.launcher.wait();
    }
}

#[test]
fn top_shows_both_ranks_of_a_running_job_and_then_their_end() {
    let Some((tmp, model, tweets)) = tiny_bert_and_tweets(true) else {
        return;
    };
    let out = tmp.path().join("ddp");
    let total = 100_000u64;
    let port = free_ports(2).to_string();
    let _job = Job {
        launcher: kiln_one_thread()
            .args(["launch", "--nproc-per-node", "2", "--master-port", &port])
            .args(["--timeout", "60", "--"])
            .args(train_args(&model, &tweets, 8, &out, total as usize))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    };
    // Both ranks publish and train.
    let first = wait_for(&out, Duration::from_secs(120), "two ranks training", |s| {
        let r = s["ranks"].as_array().unwrap();
        r.len() == 2
            && r.iter()
                .all(|r| r["status"] == "training" && r["step"].as_u64() > Some(0))
    });
    for (i, r) in first["ranks"].as_array().unwrap().iter().enumerate() {
        assert_eq!(r["rank"], i);
        assert_eq!(r["world_size"], 2);
        assert_eq!(r["total_steps"], total);
        assert!(r["loss"].as_f64().unwrap().is_finite(), "{r}");
        assert!(r["learning_rate"].as_f64().unwrap() > 0.0);
        assert!(r["samples_per_second"].as_f64().unwrap() > 0.0);
        assert!(r["rss_bytes"].as_u64().unwrap() > 1 << 20);
        // Two ranks average their gradients every step: each waits some of the time.
        assert!(r["collective_seconds"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["last_seen_seconds"].as_f64().unwrap() < 5.0);
    }
    // Without a folder, `kiln top` finds the job through the per-user runtime folder.
    let found = kiln_one_thread()
        .args(["top", "--once", "--json"])
        .output()
        .unwrap();
    let found: Value = serde_json::from_slice(&found.stdout).unwrap_or_default();
    let here = std::path::absolute(&out).unwrap().display().to_string();
    assert!(
        found["ranks"]
            .as_array()
            .is_some_and(|r| r.iter().any(|r| r["output_dir"] == here.as_str())),
        "{found}"
    );

    // The screen, in a pseudo-terminal.
    let (rows, cols) = (30, 170);
    let pty = native_pty_system()
        .openpty(PtySize {
            rows,
            cols,
            pixel_width: 0,
            pixel_height: 0,
        })
        .unwrap();
    let mut cmd = CommandBuilder::new(env!("CARGO_BIN_EXE_kiln"));
    cmd.args(["top", "--interval", "0.5"]);
    cmd.arg(&out);
    cmd.env("TERM", "xterm-256color");
    let mut top = pty.slave.spawn_command(cmd).unwrap();
    drop(pty.slave);
    let mut reader = pty.master.try_clone_reader().unwrap();
    let mut keys = pty.master.take_writer().unwrap();
    let (tx, rx) = mpsc::channel::<Vec<u8>>();
    std::thread::spawn(move || {
        let mut buf = [0u8; 8192];
        while let Ok(n) = reader.read(&mut buf) {
            if n == 0 || tx.send(buf[..n].to_vec()).is_err() {
                break;
            }
        }
    });
    let nz = |n: u16| std::num::NonZeroU16::new(n).unwrap();
    let mut term = vt100::Parser::new(nz(rows), nz(cols), 0);
    let mut screen_at = |deadline: Duration, ok: &dyn Fn(&str) -> bool| -> String {
        let start = Instant::now();
        loop {
            while let Ok(bytes) = rx.recv_timeout(Duration::from_millis(100)) {
                term.process(&bytes);
            }
            let s = term.screen().contents();
            if ok(&s) || start.elapsed() > deadline {
                return s;
            }
        }
    };
    let both = |s: &str| {
        screen_step(s, 0, total).is_some_and(|n| n > 0) && screen_step(s, 1, total).is_some()
    };
    let before = screen_at(Duration::from_secs(30), &both);
    eprintln!("kiln top, first screen:\n{before}");
    assert!(both(&before), "both ranks on screen:\n{before}");
    assert!(before.contains("training"), "{before}");
    assert!(
        before.contains("loss, rank 0"),
        "the sparkline of rank 0:\n{before}"
    );
    let s0 = screen_step(&before, 0, total).unwrap();
    let s1 = screen_step(&before, 1, total).unwrap();
    let after = screen_at(Duration::from_secs(60), &|s| {
        screen_step(s, 0, total).is_some_and(|n| n > s0)
            && screen_step(s, 1, total).is_some_and(|n| n > s1)
    });
    eprintln!("kiln top, later:\n{after}");
    assert!(
        screen_step(&after, 0, total).unwrap() > s0 && screen_step(&after, 1, total).unwrap() > s1,
        "the steps advance on screen:\n{after}"
    );
    // Down arrow picks rank 1: its sparkline.
    keys.write_all(b"\x1b[B").unwrap();
    keys.flush().unwrap();
    let picked = screen_at(Duration::from_secs(10), &|s| s.contains("loss, rank 1"));
    assert!(picked.contains("loss, rank 1"), "{picked}");
    keys.write_all(b"q").unwrap();
    keys.flush().unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(st) = top.try_wait().unwrap() {
            break st;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "q quits");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success());

    // Kill both workers outright: their ranks show as exited, not frozen.
    let pids: Vec<i32> = snapshot(&out)["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["pid"].as_i64().unwrap() as i32)
        .collect();
    let last = steps(&snapshot(&out));
    for pid in pids {
        // SAFETY: sends a signal to a worker this test started.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let gone = wait_for(&out, Duration::from_secs(20), "killed ranks shown", |s| {
        s["ranks"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r["status"] == "exited")
    });
    assert!(steps(&gone).iter().zip(&last).all(|(a, b)| a >= b));
}
