//! The command line before clap reads it (`cli`, the command clap will parse it as): flag names spelled with underscores take dashes, the
//! `--` before a launched worker's command is put in where it was left out, and the transformers
//! flags `train` has no clap option for are taken out (hf_flags.rs) and handed to `kiln train`.

use crate::hf_flags::{self, normalize_flag, HfFlags};

/// The program's arguments (`std::env::args_os()`) as clap is to parse them, and the transformers
/// flags taken out of them. An argument that is not UTF-8 (a file name
/// in another encoding) passes through as it is: clap takes it as a path, or says in one
/// sentence that the option needs UTF-8.
pub fn prepare_os(
    args: Vec<std::ffi::OsString>,
    cli: &clap::Command,
) -> (Vec<std::ffi::OsString>, HfFlags) {
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
    let (argv, hf) = prepare(strings, cli);
    let argv = argv
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
        .collect();
    (argv, hf)
}

/// [`prepare_os`] on arguments that are UTF-8.
pub fn prepare(args: Vec<String>, cli: &clap::Command) -> (Vec<String>, HfFlags) {
    // Flags before a `--` are normalised; a launched worker's own arguments pass through untouched.
    let mut after_dashes = false;
    let argv: Vec<String> = separate_worker_command(args, cli)
        .into_iter()
        .map(|a| {
            if after_dashes {
                return a;
            }
            after_dashes = a == "--";
            normalize_flag(a)
        })
        .collect();
    hf_flags::take_hf_flags(argv, &train_flag_names(cli))
}

/// Every long flag name (and alias) clap knows for `train`, global ones included.
fn train_flag_names(cli: &clap::Command) -> Vec<String> {
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
fn separate_worker_command(mut argv: Vec<String>, cli: &clap::Command) -> Vec<String> {
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
