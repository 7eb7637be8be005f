//! What `kiln` prints from data files reaches a terminal: label names with escape sequences
//! (a title change, a screen clear) are printed escaped, never raw; and a reader that stops
//! reading (`kiln … | head -1`) ends kiln quietly.

mod kiln_bin;

use kiln_bin::kiln;
use kiln_testkit::common;

#[test]
fn eval_escapes_label_names_from_files() {
    let Some(minilm) = common::asset("minilm") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    common::tiny_model_with(
        &model,
        &minilm,
        serde_json::json!({
            "id2label": {"0": "pos\u{1b}]0;pwned\u{7}", "1": "neg\u{1b}[2J"},
            "label2id": {"pos\u{1b}]0;pwned\u{7}": 0, "neg\u{1b}[2J": 1},
        }),
    );
    let data = tmp.path().join("eval.csv");
    let (pos, neg) = ("pos\u{1b}]0;pwned\u{7}", "neg\u{1b}[2J");
    std::fs::write(
        &data,
        format!("text,label\ngood day,{pos}\nbad day,{neg}\nfine,{pos}\nawful,{neg}\n"),
    )
    .unwrap();
    let out = kiln()
        .args(["eval", "--model"])
        .arg(&model)
        .arg("--eval-file")
        .arg(&data)
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    // The per-class lines are there, with the names escaped.
    assert!(stdout.contains("pos\\u{1b}]0;pwned\\u{7}"), "{stdout}");
    for (what, bytes) in [("stdout", &out.stdout), ("stderr", &out.stderr)] {
        assert!(
            !bytes.iter().any(|&b| b == 0x1b || b == 0x07),
            "a control character reached the terminal on {what}: {stdout}{stderr}"
        );
    }
}

/// Errors quote names from files (a CSV column, a config key): escaped, never raw.
#[test]
fn errors_escape_names_from_files() {
    let Some((tmp, model, _)) = common::tiny_bert_and_tweets(false) else {
        return;
    };
    let csv = tmp.path().join("hdr.csv");
    std::fs::write(&csv, "te\u{1b}]0;pwned\u{7}xt,label\nhello,negative\n").unwrap();
    let yaml = tmp.path().join("key.yaml");
    // YAML's own escapes: the key holds ESC [2J and a right-to-left override.
    std::fs::write(&yaml, "max_steps: 1\n\"\\e[2J\\u202e\": 1\n").unwrap();
    for (extra, expect) in [
        (vec![], "te\\u{1b}]0;pwned\\u{7}xt"),
        (
            vec!["--config".to_string(), yaml.display().to_string()],
            "\\u{1b}[2J\\u{202e}",
        ),
    ] {
        let out = kiln()
            .args(["train", "--model"])
            .arg(&model)
            .arg("--train-file")
            .arg(&csv)
            .args(["--max-steps", "1", "--output-dir"])
            .arg(tmp.path().join("out"))
            .args(&extra)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(err.contains(expect), "{expect}: {err}");
        assert!(
            !out.stderr.iter().any(|&b| b == 0x1b || b == 0x07),
            "a control character reached the terminal: {err}"
        );
        assert!(
            !err.contains('\u{202e}'),
            "a bidi override reached the terminal"
        );
    }
}

/// `kiln predict … | head -1`: the reader closes the pipe before kiln prints (it is still loading
/// the model), and kiln ends as a Unix tool ends on a closed pipe (status 141, nothing on stderr
/// about it), not in a panic.
#[test]
fn a_closed_stdout_ends_kiln_quietly() {
    let model = common::repo_root().join("tests/fixtures/reward/tiny_chat_llama_rm");
    let mut cmd = kiln();
    cmd.args(["predict", "--model"]).arg(&model);
    for i in 0..50 {
        cmd.args(["--text", &format!("text number {i}")]);
    }
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(141), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(!stderr.contains("Broken pipe"), "{stderr}");
}
