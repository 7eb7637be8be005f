//! transformers' TrainingArguments flags that kiln takes on `train`'s command line without a clap
//! option of its own: recorded fields (`--hub_model_id none`, `--dataloader_num_workers 4`), older
//! names (`--evaluation_strategy steps`), and the unknown flags `--ignore-unknown-args` lets pass.
//! They are taken out of the arguments before clap parses the rest, so `--help` stays readable.

use kiln::train::hf_fields::{lookup, Disposition};
use serde_json::{Map, Value};

/// What the pre-pass took out of `train`'s arguments.
#[derive(Debug, Default)]
pub struct HfFlags {
    /// Recorded / only-neutral fields, with their values as JSON.
    pub entries: Map<String, Value>,
    /// Unknown flags dropped under --ignore-unknown-args.
    pub ignored: Vec<String>,
}

/// Splits `argv` (normalised: dashed flag names) into what clap parses and the transformers
/// flags kiln records. Only `train`'s own arguments are looked at (a launched worker's, after
/// `--`, pass through). `known` holds the long names clap knows for `train`.
pub fn take_hf_flags(argv: Vec<String>, known: &[String]) -> (Vec<String>, HfFlags) {
    let mut out = HfFlags::default();
    let Some(train) = argv.iter().position(|a| a == "train") else {
        return (argv, out);
    };
    if argv[..train].iter().any(|a| a == "--") {
        return (argv, out);
    }
    let ignore_unknown = argv.iter().any(|a| a == "--ignore-unknown-args");
    let mut kept: Vec<String> = argv[..=train].to_vec();
    let mut rest = argv[train + 1..].iter().cloned().peekable();
    while let Some(arg) = rest.next() {
        if arg == "--" {
            kept.push(arg);
            kept.extend(rest.by_ref());
            break;
        }
        let Some(flag) = arg.strip_prefix("--") else {
            kept.push(arg);
            continue;
        };
        let (name, inline) = match flag.split_once('=') {
            Some((n, v)) => (n.to_string(), Some(v.to_string())),
            None => (flag.to_string(), None),
        };
        if known.contains(&name) {
            kept.push(arg);
            continue;
        }
        let field = name.replace('-', "_");
        // The value: `--flag=v`, or the next argument unless it is a flag (then a bare flag: true).
        let mut value = || {
            inline
                .clone()
                .or_else(|| rest.next_if(|next| !next.starts_with("--")))
        };
        match lookup(&field) {
            Some(Disposition::Renamed(new)) => {
                kept.push(format!("--{}", new.replace('_', "-")));
                kept.extend(value());
            }
            Some(_) => {
                let v = value();
                out.entries.insert(field, json_value(v.as_deref()));
            }
            None if ignore_unknown => {
                let v = value();
                out.ignored
                    .push(v.map_or(format!("--{name}"), |v| format!("--{name} {v}")));
            }
            // clap names it in its error.
            None => kept.push(arg),
        }
    }
    (kept, out)
}

/// A flag's value as JSON, as HfArgumentParser reads it: `True`/`False`, numbers, JSON lists and
/// objects, else the text; a bare flag is true.
fn json_value(v: Option<&str>) -> Value {
    let Some(v) = v else {
        return Value::Bool(true);
    };
    match v.to_ascii_lowercase().as_str() {
        "true" => return Value::Bool(true),
        "false" => return Value::Bool(false),
        "none" | "null" => return Value::Null,
        _ => {}
    }
    serde_json::from_str(v).unwrap_or_else(|_| Value::String(v.to_string()))
}

/// Hugging Face scripts spell flags with underscores (`--per_device_train_batch_size`); accept both.
pub fn normalize_flag(arg: String) -> String {
    match arg.strip_prefix("--") {
        Some(rest) if rest.contains('_') => {
            let (name, value) = rest
                .split_once('=')
                .map_or((rest, None), |(n, v)| (n, Some(v)));
            let name = name.replace('_', "-");
            match value {
                Some(v) => format!("--{name}={v}"),
                None => format!("--{name}"),
            }
        }
        _ => arg,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn recorded_and_renamed_flags_leave_clap_the_rest() {
        let known = vec![
            "model".to_string(),
            "eval-strategy".into(),
            "bf16".into(),
            "ignore-unknown-args".into(),
        ];
        let (kept, hf) = take_hf_flags(
            args("kiln train --model m --hub-model-id none --dataloader-num-workers=4 --do-train --evaluation-strategy steps --bf16"),
            &known,
        );
        assert_eq!(
            kept,
            args("kiln train --model m --eval-strategy steps --bf16")
        );
        assert_eq!(hf.entries["hub_model_id"], Value::Null);
        assert_eq!(hf.entries["dataloader_num_workers"], Value::from(4));
        assert_eq!(hf.entries["do_train"], Value::Bool(true));
        // Unknown flags stay for clap to refuse, unless --ignore-unknown-args.
        let (kept, _) = take_hf_flags(args("kiln train --nonsense 3"), &known);
        assert_eq!(kept, args("kiln train --nonsense 3"));
        let (kept, hf) = take_hf_flags(
            args("kiln train --nonsense 3 --ignore-unknown-args --model m"),
            &known,
        );
        assert_eq!(kept, args("kiln train --ignore-unknown-args --model m"));
        assert_eq!(hf.ignored, vec!["--nonsense 3".to_string()]);
        // A launched worker's arguments are not touched.
        let (kept, hf) = take_hf_flags(args("kiln launch -- train --report-to none"), &known);
        assert_eq!(kept, args("kiln launch -- train --report-to none"));
        assert!(hf.entries.is_empty());
    }
}
