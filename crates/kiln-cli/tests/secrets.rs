//! Nothing kiln writes or prints holds a secret: a Hub token given by flag, by a config file or by
//! the environment is found in no file of the run (training_args.json at the top and in every
//! checkpoint, TensorBoard's events, log.jsonl, the model card) nor in its output; transformers'
//! `<HUB_TOKEN>` stands in its place.

mod kiln_bin;

use std::path::Path;

use kiln_bin::kiln_one_thread;
use kiln_testkit::common::{tiny_bert_and_tweets, train_args};

/// Every regular file under `dir`, recursively.
fn files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = vec![];
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(files(&p));
        } else {
            out.push(p);
        }
    }
    out
}

fn contains(hay: &[u8], needle: &str) -> bool {
    hay.windows(needle.len()).any(|w| w == needle.as_bytes())
}

#[test]
fn a_token_given_by_flag_config_or_environment_is_in_no_file_or_line() {
    let Some((tmp, model, tweets)) = tiny_bert_and_tweets(false) else {
        return;
    };
    let secrets = [
        "hf_FLAGsecret0123456789",
        "hf_CONFIGsecret0123456789",
        "hf_PUSHsecret0123456789",
        "hf_ENVsecret0123456789",
    ];
    let out = tmp.path().join("run");
    let cfg = tmp.path().join("args.yaml");
    std::fs::write(
        &cfg,
        format!(
            "hub_token: {}\npush_to_hub_token: {}\n",
            secrets[1], secrets[2]
        ),
    )
    .unwrap();
    // The flag overrides the config's hub_token; a second run takes the config's alone.
    for (name, flag) in [("flag", true), ("config", false)] {
        let out = out.join(name);
        let mut args = train_args(&model, &tweets, 8, &out, 4);
        let at = args.iter().position(|a| a == "--save-strategy").unwrap();
        args.drain(at..at + 2);
        args.extend(
            [
                "--save-strategy",
                "steps",
                "--save-steps",
                "2",
                "--report-to",
                "tensorboard",
                "--logging-steps",
                "1",
                "--config",
            ]
            .map(String::from),
        );
        args.push(cfg.to_string_lossy().into());
        if flag {
            args.extend(["--hub-token".to_string(), secrets[0].to_string()]);
        }
        let o = kiln_one_thread()
            .env("KILN_LOG", "debug")
            .env("HF_TOKEN", secrets[3])
            .args(&args)
            .output()
            .unwrap();
        let said = [o.stdout, o.stderr].concat();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&said));
        let written = files(&out);
        assert!(written.len() > 8, "{written:?}");
        for s in secrets {
            assert!(!contains(&said, s), "{name}: the output holds {s}");
            for f in &written {
                let bytes = std::fs::read(f).unwrap();
                assert!(!contains(&bytes, s), "{name}: {} holds {s}", f.display());
            }
        }
        let args_json = std::fs::read_to_string(out.join("training_args.json")).unwrap();
        assert!(args_json.contains("<HUB_TOKEN>"), "{args_json}");
        assert!(out.join("checkpoint-2/training_args.json").exists());
    }
}
