//! How Hugging Face scripts and config files write values: booleans as `HfArgumentParser` reads
//! them, and where a key of a config file is set (for errors that name the line). A leaf: the
//! arguments, the field table and the optimizers' `optim_args` all read values this way.

/// A boolean flag's value as Hugging Face scripts write it: `True`/`False` (any case), `1`/`0`,
/// `yes`/`no` (HfArgumentParser's `string_to_bool`); a bare flag means true.
pub fn hf_bool(s: &str) -> std::result::Result<bool, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "y" | "t" => Ok(true),
        "false" | "0" | "no" | "n" | "f" => Ok(false),
        other => Err(format!("{other:?} is not a boolean (True or False)")),
    }
}

/// The 1-based line where `key` (a path like `a.b` names its first part) is set in a YAML or
/// JSON file's text, or 0.
pub fn line_of_key(text: &str, key: &str) -> usize {
    let key = key.split(['.', '[']).next().unwrap_or(key);
    text.lines()
        .position(|l| {
            let l = l.trim_start().trim_start_matches("- ");
            l.starts_with(&format!("\"{key}\"")) || l.starts_with(&format!("{key}:"))
        })
        .map_or(0, |i| i + 1)
}
