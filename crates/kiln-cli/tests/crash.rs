//! Crash consistency: training is killed with SIGKILL at many points — inside a checkpoint's write,
//! between its last file and its rename, right after the rename, in the middle of a rotation, in
//! the middle of the final model's renames, and at random moments. After every kill, each
//! `checkpoint-N` folder left must be complete and loadable, and resuming from `latest` must end
//! bit-identical to a run that was never interrupted.

mod kiln_bin;

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use kiln_bin::kiln_one_thread;
use kiln_testkit::common::{tiny_bert_and_tweets as setup, train_args};
use rand::{Rng, SeedableRng};

const STEPS: usize = 8;

/// A short run that saves every step and keeps two checkpoints: every step writes a checkpoint
/// and deletes one.
fn args(model: &Path, tweets: &Path, out: &Path) -> Vec<String> {
    let mut a = train_args(model, tweets, 8, out, STEPS);
    let save = a.iter().position(|x| x == "--save-strategy").unwrap();
    a[save + 1] = "steps".into();
    a.extend(
        [
            "--save-steps",
            "1",
            "--save-total-limit",
            "2",
            "--logging-steps",
            "1",
        ]
        .iter()
        .map(|s| s.to_string()),
    );
    a
}

/// Every `checkpoint-N` folder is whole: kiln's marker, each file at its recorded size, the
/// weights and optimizer state parse, the trainer state is at step N. Returns the damaged ones.
fn damaged_checkpoints(out: &Path) -> Vec<String> {
    let mut bad = Vec::new();
    for c in kiln::train::checkpoint::list_checkpoints(out) {
        let name = c.path.display().to_string();
        if let Some(d) = &c.damage {
            bad.push(format!("{name}: {d}"));
            continue;
        }
        for f in ["model.safetensors", "optimizer.safetensors"] {
            if let Err(e) = kiln::formats::safetensors::read_safetensors(&c.path.join(f)) {
                bad.push(format!("{name}: {e}"));
            }
        }
        match kiln::io::read_json::<kiln::train::checkpoint::TrainerState>(
            &c.path.join("trainer_state.json"),
        ) {
            Ok(s) if s.global_step == c.step => {}
            Ok(s) => bad.push(format!("{name}: trainer state at step {}", s.global_step)),
            Err(e) => bad.push(format!("{name}: {e}")),
        }
    }
    bad
}

/// Runs to the end: resumes from `latest` when a complete checkpoint exists, else starts over in
/// the same folder (the interrupted run left only its record there).
fn finish(model: &Path, tweets: &Path, out: &Path) {
    let resumable = kiln::train::checkpoint::list_checkpoints(out)
        .iter()
        .any(|c| c.is_complete_of(None));
    let mut cmd = kiln_one_thread();
    cmd.stdout(Stdio::null()).stderr(Stdio::piped());
    cmd.args(args(model, tweets, out));
    if resumable {
        cmd.args(["--resume-from-checkpoint", "latest"]);
    } else {
        cmd.arg("--overwrite-output-dir");
    }
    let o = cmd.output().unwrap();
    assert!(
        o.status.success(),
        "resuming {} failed: {}",
        out.display(),
        String::from_utf8_lossy(&o.stderr)
    );
}

fn final_weights(out: &Path) -> Vec<u8> {
    std::fs::read(out.join("model.safetensors")).unwrap()
}

/// Hidden leftovers of an interrupted run (they are removed by the next start).
fn leftovers(out: &Path) -> Vec<String> {
    std::fs::read_dir(out)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().to_string())
                .filter(|n| n.starts_with(".kiln-"))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn sigkill_anywhere_leaves_whole_checkpoints_and_resume_is_bit_exact() {
    let Some((tmp, model, tweets)) = setup(true) else {
        return;
    };
    let reference = tmp.path().join("reference");
    let t0 = Instant::now();
    let o = kiln_one_thread()
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .args(args(&model, &tweets, &reference))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let run_time = t0.elapsed();
    let expected = final_weights(&reference);

    // Aimed kills: (crash point, which pass through it). A checkpoint is 7 files and a marker.
    let aimed: Vec<(&str, u64)> = vec![
        ("checkpoint:file", 1),
        ("checkpoint:file", 5),
        ("checkpoint:file", 9),
        ("checkpoint:file", 23),
        ("checkpoint:complete", 1),
        ("checkpoint:complete", 3),
        ("checkpoint:complete", 6),
        ("checkpoint:renamed", 1),
        ("checkpoint:renamed", 4),
        ("checkpoint:renamed", STEPS as u64),
        ("remove_dir:renamed", 1),
        ("remove_dir:renamed", 3),
        ("remove_dir:renamed", 5),
        ("replace_files:rename", 1),
        ("replace_files:rename", 3),
    ];
    let mut kills = 0;
    let mut damaged = Vec::new();
    let mut cases = 0;
    for (i, (point, n)) in aimed.iter().enumerate() {
        let out = tmp.path().join(format!("aimed-{i}"));
        let st = kiln_one_thread()
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .args(args(&model, &tweets, &out))
            .env("KILN_TEST_CRASH_AT", format!("{point}:{n}"))
            .status()
            .unwrap();
        assert_eq!(
            st.signal(),
            Some(libc::SIGKILL),
            "{point}:{n} was never reached"
        );
        kills += 1;
        cases += 1;
        damaged.extend(damaged_checkpoints(&out));
        finish(&model, &tweets, &out);
        assert!(leftovers(&out).is_empty(), "{:?}", leftovers(&out));
        assert!(
            final_weights(&out) == expected,
            "after a kill at {point}:{n}, the resumed run's weights differ from the uninterrupted run's"
        );
    }

    // Kills at random moments of the run (seeded), several in a row before the run is let finish.
    let mut rng = rand::rngs::StdRng::seed_from_u64(13);
    for i in 0..6 {
        let out = tmp.path().join(format!("random-{i}"));
        for _ in 0..4 {
            let resumable = kiln::train::checkpoint::list_checkpoints(&out)
                .iter()
                .any(|c| c.is_complete_of(None));
            let mut cmd = kiln_one_thread();
            cmd.stdout(Stdio::null()).stderr(Stdio::piped());
            cmd.args(args(&model, &tweets, &out));
            if resumable {
                cmd.args(["--resume-from-checkpoint", "latest"]);
            } else if out.exists() {
                cmd.arg("--overwrite-output-dir");
            }
            let mut child = cmd.spawn().unwrap();
            let at = rng.random_range(0.05..0.8) * run_time.as_secs_f64();
            std::thread::sleep(Duration::from_secs_f64(at));
            if child.try_wait().unwrap().is_none() {
                child.kill().unwrap();
                kills += 1;
            }
            child.wait().unwrap();
            damaged.extend(damaged_checkpoints(&out));
        }
        cases += 1;
        finish(&model, &tweets, &out);
        assert!(
            final_weights(&out) == expected,
            "after random kills, run {i}'s weights differ from the uninterrupted run's"
        );
    }
    eprintln!(
        "{kills} SIGKILLs in {cases} runs: {} damaged checkpoint folders; every resumed run \
         bit-identical to the uninterrupted one",
        damaged.len()
    );
    assert!(damaged.is_empty(), "damaged checkpoints: {damaged:#?}");
}
