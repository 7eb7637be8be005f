//! The command line before clap reads it: flag names spelled with underscores take dashes, the
//! `--` before a launched worker's command is put in where it was left out, and the transformers
//! flags `train` has no clap option for are taken out (hf_flags.rs) and kept for `kiln train`.

use clap::CommandFactory;

use crate::{hf_flags, Cli};

/// transformers flags `train` took that clap does not parse (see hf_flags.rs).
pub static HF_FLAGS: std::sync::OnceLock<hf_flags::HfFlags> = std::sync::OnceLock::new();

/// The program's arguments (`std::env::args_os()`) as clap is to parse them; the transformers
/// flags taken out of them are left in [`HF_FLAGS`]. An argument that is not UTF-8 (a file name
/// in another encoding) passes through as it is: clap takes it as a path, or says in one
/// sentence that the option needs UTF-8.
pub fn prepare_os(args: Vec<std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    // Each non-UTF-8 argument stands in the string pass as a placeholder no real argument holds
    // (U+E002 is private-use), and is put back after it.
    let mut raw = Vec::new();
    let strings: Vec<String> = args
        .into_iter()
        .map(|a| match a.into_string() {
            Ok(s) => s,
            Err(os) => {
                raw.push(os);
                format!("\u{E002}kiln-raw-arg-{}", raw.len() - 1)
            }
        })
        .collect();
    prepare(strings)
        .into_iter()
        .map(|a| {
            match a
                .strip_prefix("\u{E002}kiln-raw-arg-")
                .and_then(|i| i.parse::<usize>().ok())
                .and_then(|i| raw.get(i))
            {
                Some(os) => os.clone(),
                None => a.into(),
            }
        })
        .collect()
}

/// [`prepare_os`] on arguments that are UTF-8.
pub fn prepare(args: Vec<String>) -> Vec<String> {
    // Flags before a `--` are normalised; a launched worker's own arguments pass through untouched.
    let mut after_dashes = false;
    let argv: Vec<String> = separate_worker_command(args)
        .into_iter()
        .map(|a| {
            if after_dashes {
                return a;
            }
            after_dashes = a == "--";
            normalize_flag(a)
        })
        .collect();
    let (argv, hf) = hf_flags::take_hf_flags(argv, &train_flag_names());
    HF_FLAGS.set(hf).expect("set once");
    argv
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

/// Every long flag name (and alias) clap knows for `train`, global ones included.
fn train_flag_names() -> Vec<String> {
    let cli = Cli::command();
    let train = cli.find_subcommand("train").expect("a train subcommand");
    let mut names: Vec<String> = train
        .get_arguments()
        .chain(cli.get_arguments())
        .flat_map(|a| {
            a.get_long()
                .into_iter()
                .chain(a.get_all_aliases().unwrap_or_default())
                .map(str::to_string)
        })
        .collect();
    names.extend(["help".to_string(), "version".to_string()]);
    names
}

/// Puts the `--` that `launch` and `precompile` take before their worker command when the user
/// left it out (torchrun needs none): the worker's arguments are then its own, never read as
/// the launcher's or normalised here.
fn separate_worker_command(mut argv: Vec<String>) -> Vec<String> {
    let cli = Cli::command();
    let Some(at) = argv.iter().position(|a| a == "launch" || a == "precompile") else {
        return argv;
    };
    let sub = cli
        .find_subcommand(&argv[at])
        .expect("launch and precompile are subcommands");
    let takes_value = |name: &str| {
        sub.get_arguments()
            .chain(cli.get_arguments())
            .find(|a| a.get_long() == Some(name))
            .is_some_and(|a| a.get_action().takes_values())
    };
    let mut i = at + 1;
    while i < argv.len() {
        let a = &argv[i];
        if a == "--" {
            return argv;
        }
        match a.strip_prefix("--") {
            Some(flag) if !flag.contains('=') => {
                i += 1 + usize::from(takes_value(&flag.replace('_', "-")));
            }
            Some(_) => i += 1,
            None if a.starts_with('-') => i += 1,
            None => {
                argv.insert(i, "--".into());
                return argv;
            }
        }
    }
    argv
}
