//! What chat templates call that Python defines, as transformers' Jinja environment has it:
//! `raise_exception`, `strftime_now`, and `tojson` with Python's `json.dumps`, `str` and `repr`
//! of values (float repr, ASCII escapes, key order), so a template renders the same text.

use minijinja::value::{Kwargs, Rest, ValueKind};
use minijinja::{Error as JinjaError, ErrorKind, Value};
use std::fmt::Write as _;

/// The error raised by the template's own `raise_exception(msg)`.
#[derive(Debug)]
pub(crate) struct Raised;

pub(crate) fn raise_exception(message: String) -> Result<Value, JinjaError> {
    Err(JinjaError::new(ErrorKind::InvalidOperation, message).with_source(Raised))
}

/// `datetime.now().strftime(fmt)`: the C library's `strftime` on local time, which Python calls
/// too (Python's own `%f`, `%z` and `%Z` handling aside).
pub(crate) fn strftime_now(format: String) -> Result<String, JinjaError> {
    let fmt = std::ffi::CString::new(format).map_err(|_| {
        JinjaError::new(
            ErrorKind::InvalidOperation,
            "strftime_now: the format contains a NUL character",
        )
    })?;
    // SAFETY: `time` and `localtime_r` write into the locals given; `strftime` writes at most
    // `buf.len()` bytes into `buf` and reads the NUL-terminated `fmt`.
    unsafe {
        let now = libc::time(std::ptr::null_mut());
        let mut tm: libc::tm = std::mem::zeroed();
        if libc::localtime_r(&now, &mut tm).is_null() {
            return Err(JinjaError::new(
                ErrorKind::InvalidOperation,
                "strftime_now: cannot read the local time",
            ));
        }
        let mut cap = 256;
        loop {
            let mut buf = vec![0u8; cap];
            let n = libc::strftime(buf.as_mut_ptr().cast(), cap, fmt.as_ptr(), &tm);
            if n > 0 || cap >= 1 << 16 {
                buf.truncate(n);
                return Ok(String::from_utf8_lossy(&buf).into_owned());
            }
            cap *= 16;
        }
    }
}

/// transformers' `tojson` filter: `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`, positional arguments in that order.
pub(crate) fn tojson(
    value: Value,
    args: Rest<Value>,
    kwargs: Kwargs,
) -> Result<String, JinjaError> {
    let names = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if args.len() > names.len() {
        return Err(JinjaError::new(
            ErrorKind::TooManyArguments,
            "tojson takes at most 4 arguments",
        ));
    }
    let mut opts: [Option<Value>; 4] = Default::default();
    for (i, a) in args.iter().enumerate() {
        opts[i] = Some(a.clone());
    }
    for (i, name) in names.iter().enumerate() {
        if let Some(v) = kwargs.get::<Option<Value>>(name)? {
            if opts[i].is_some() {
                return Err(JinjaError::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson got multiple values for argument '{name}'"),
                ));
            }
            opts[i] = Some(v);
        }
    }
    kwargs.assert_all_used()?;
    let [ensure_ascii, indent, separators, sort_keys] = opts;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(match v.as_str() {
            Some(s) => s.to_string(),
            None => " ".repeat(v.as_i64().unwrap_or(0).max(0) as usize),
        }),
    };
    let (item_sep, key_sep) = match separators.filter(|s| !s.is_none()) {
        Some(seps) => {
            let parts: Vec<Value> = seps.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] if a.as_str().is_some() && b.as_str().is_some() => (
                    a.as_str().unwrap_or_default().to_string(),
                    b.as_str().unwrap_or_default().to_string(),
                ),
                _ => {
                    return Err(JinjaError::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be two strings",
                    ))
                }
            }
        }
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let dumper = JsonDumper {
        ensure_ascii: ensure_ascii.is_some_and(|v| v.is_true()),
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.is_some_and(|v| v.is_true()),
    };
    let mut out = String::new();
    dumper.dump(&value, 0, &mut out)?;
    Ok(out)
}

/// Python's `json.dumps`, on minijinja values.
pub(crate) struct JsonDumper {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

impl JsonDumper {
    pub(crate) fn dump(&self, v: &Value, level: usize, out: &mut String) -> Result<(), JinjaError> {
        match v.kind() {
            ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => out.push_str(&number_json(v)),
            ValueKind::String => {
                json_string(v.as_str().unwrap_or_default(), self.ensure_ascii, out)
            }
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                self.container(out, level, '[', ']', &items, |item, level, out| {
                    self.dump(item, level, out)
                })?;
            }
            ValueKind::Map => {
                let mut entries = Vec::new();
                for key in v.try_iter()? {
                    let value = v.get_item(&key)?;
                    let key = match key.kind() {
                        ValueKind::String => key.as_str().unwrap_or_default().to_string(),
                        ValueKind::Number => number_json(&key),
                        ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).into(),
                        ValueKind::None => "null".into(),
                        _ => {
                            return Err(JinjaError::new(
                                ErrorKind::InvalidOperation,
                                format!(
                                    "tojson: keys must be str, int, float, bool or None, not {}",
                                    key.kind()
                                ),
                            ))
                        }
                    };
                    entries.push((key, value));
                }
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(&b.0));
                }
                self.container(out, level, '{', '}', &entries, |(k, val), level, out| {
                    json_string(k, self.ensure_ascii, out);
                    out.push_str(&self.key_sep);
                    self.dump(val, level, out)
                })?;
            }
            kind => {
                return Err(JinjaError::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: a value of type {kind} is not JSON serializable"),
                ))
            }
        }
        Ok(())
    }

    pub(crate) fn container<T>(
        &self,
        out: &mut String,
        level: usize,
        open: char,
        close: char,
        items: &[T],
        mut each: impl FnMut(&T, usize, &mut String) -> Result<(), JinjaError>,
    ) -> Result<(), JinjaError> {
        out.push(open);
        if items.is_empty() {
            out.push(close);
            return Ok(());
        }
        for (i, item) in items.iter().enumerate() {
            if i > 0 {
                out.push_str(&self.item_sep);
            }
            if let Some(ind) = &self.indent {
                out.push('\n');
                out.push_str(&ind.repeat(level + 1));
            }
            each(item, level + 1, out)?;
        }
        if let Some(ind) = &self.indent {
            out.push('\n');
            out.push_str(&ind.repeat(level));
        }
        out.push(close);
        Ok(())
    }
}

/// A number as Python's `json.dumps` writes it (floats as `repr`, `NaN`, `Infinity`).
pub(crate) fn number_json(v: &Value) -> String {
    if v.is_integer() {
        return v.to_string();
    }
    match f64::try_from(v.clone()) {
        Ok(f) if f.is_nan() => "NaN".into(),
        Ok(f) if f.is_infinite() => (if f > 0.0 { "Infinity" } else { "-Infinity" }).into(),
        Ok(f) => py_float_repr(f),
        Err(_) => v.to_string(),
    }
}

/// Python's `repr(float)`: the shortest round-tripping digits, positional for exponents from -4 to
/// 15, else `1.5e+16` style.
pub(crate) fn py_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return (if f > 0.0 { "inf" } else { "-inf" }).into();
    }
    let sci = format!("{f:e}"); // e.g. "-1.2345e-5": shortest round-trip digits
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let negative = mantissa.starts_with('-');
    let digits: String = mantissa.chars().filter(|c| c.is_ascii_digit()).collect();
    let mut out = String::new();
    if negative {
        out.push('-');
    }
    if (-4..16).contains(&exp) {
        if exp >= 0 {
            let int_len = exp as usize + 1;
            if digits.len() <= int_len {
                out.push_str(&digits);
                out.push_str(&"0".repeat(int_len - digits.len()));
                out.push_str(".0");
            } else {
                out.push_str(&digits[..int_len]);
                out.push('.');
                out.push_str(&digits[int_len..]);
            }
        } else {
            out.push_str("0.");
            out.push_str(&"0".repeat((-exp - 1) as usize));
            out.push_str(&digits);
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
    out
}

/// A JSON string as Python's `json.dumps` escapes it.
pub(crate) fn json_string(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{u:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `str()` of a template value, which is what Jinja prints.
pub(crate) fn py_str(v: &Value) -> String {
    match v.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::String => v.as_str().unwrap_or_default().to_string(),
        _ => py_repr(v),
    }
}

/// Python's `repr()` of a template value (how it prints inside a list or dict).
pub(crate) fn py_repr(v: &Value) -> String {
    match v.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::None => "None".into(),
        ValueKind::Bool => (if v.is_true() { "True" } else { "False" }).into(),
        ValueKind::Number if v.is_integer() => v.to_string(),
        ValueKind::Number => match f64::try_from(v.clone()) {
            Ok(f) => py_float_repr(f),
            Err(_) => v.to_string(),
        },
        ValueKind::String => py_repr_str(v.as_str().unwrap_or_default()),
        ValueKind::Seq => match v.try_iter() {
            Ok(items) => {
                let items: Vec<String> = items.map(|i| py_repr(&i)).collect();
                if v.is_tuple() {
                    if items.len() == 1 {
                        format!("({},)", items[0])
                    } else {
                        format!("({})", items.join(", "))
                    }
                } else {
                    format!("[{}]", items.join(", "))
                }
            }
            Err(_) => v.to_string(),
        },
        ValueKind::Map => match v.try_iter() {
            Ok(keys) => {
                let items: Vec<String> = keys
                    .map(|k| {
                        let val = v.get_item(&k).unwrap_or_default();
                        format!("{}: {}", py_repr(&k), py_repr(&val))
                    })
                    .collect();
                format!("{{{}}}", items.join(", "))
            }
            Err(_) => v.to_string(),
        },
        _ => v.to_string(),
    }
}

/// Python's `repr(str)`: single quotes unless the string holds `'` and no `"`.
pub(crate) fn py_repr_str(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || (0x7f..0xa0).contains(&(c as u32)) => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}
