//! RFC 4180 quote checking for CSV/TSV text, before the `csv` crate parses it.
//!
//! The `csv` crate (like Python's `csv` module) is lenient about quotes: a quoted field that is never
//! closed runs to the end of the file, and text after a closing quote is glued onto the field. Either
//! way one bad quote silently merges the rows after it into one. This scan finds such records so the
//! reader can count them as malformed and blank them out, and the `csv` crate then reads the rest of
//! the file normally.
//!
//! The scan follows the `csv` crate's own state machine (a quote opens a quoted field only as the
//! first character of a field; `""` inside one is a quote; `\r`, `\n` and `\r\n` end records; empty
//! lines are skipped; a UTF-8 BOM at the start is ignored), so on every record it accepts the two
//! agree on where fields and records end.

use std::borrow::Cow;

/// A record with a malformed quoted field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadQuote {
    /// 1-based line of the quote that opened the malformed field.
    pub line: usize,
    /// The byte range to blank: from the start of the record to the end of the opening quote's line.
    pub start: usize,
    pub end: usize,
    pub reason: String,
    /// Whether this is the first record of the text (the header row).
    pub first_record: bool,
}

/// The records of `text` whose quoted fields are malformed, in file order. After a malformed record,
/// scanning resumes on the line after its opening quote: a bad quote costs its own row, never the
/// rows after it.
pub fn find_bad_quotes(text: &str, delim: u8) -> Vec<BadQuote> {
    let b = text.as_bytes();
    let is_term = |c: u8| c == b'\n' || c == b'\r';
    let mut i = if text.starts_with('\u{feff}') { 3 } else { 0 };
    let mut line = 1;
    let mut records = 0usize;
    let mut bad = Vec::new();
    'records: while i < b.len() {
        if is_term(b[i]) {
            line += usize::from(b[i] == b'\n');
            i += 1;
            continue;
        }
        let start = i;
        records += 1;
        // One field per iteration; `i` is at the field's first byte.
        loop {
            if b.get(i) != Some(&b'"') {
                while i < b.len() && b[i] != delim && !is_term(b[i]) {
                    i += 1;
                }
                if i < b.len() && b[i] == delim {
                    i += 1;
                    continue;
                }
                continue 'records;
            }
            let (open, open_line) = (i, line);
            i += 1;
            let reason = loop {
                match b.get(i) {
                    None => {
                        break "unterminated quoted field opened here (no closing quote before the \
                               end of the file)"
                            .to_string()
                    }
                    Some(b'"') => match b.get(i + 1) {
                        Some(b'"') => i += 2,
                        Some(&c) if c == delim => {
                            i += 2;
                            break String::new();
                        }
                        None | Some(b'\n' | b'\r') => {
                            i += 1;
                            continue 'records;
                        }
                        Some(_) => {
                            // `i + 1` follows an ASCII quote, so it is a char boundary.
                            let after = text[i + 1..].chars().next().unwrap_or(' ');
                            break format!(
                                "quoted field opened here has {after:?} after its closing quote on \
                                 line {line} (a quote inside a quoted field must be doubled)"
                            );
                        }
                    },
                    Some(&c) => {
                        line += usize::from(c == b'\n');
                        i += 1;
                    }
                }
            };
            if reason.is_empty() {
                continue;
            }
            // Resume at the end of the opening quote's line, as if the record ended there.
            let end = b[open..]
                .iter()
                .position(|&c| is_term(c))
                .map_or(b.len(), |p| open + p);
            bad.push(BadQuote {
                line: open_line,
                start,
                end,
                reason,
                first_record: records == 1,
            });
            i = end;
            line = open_line;
            continue 'records;
        }
    }
    bad
}

/// `text` with the bytes of each bad record removed except its line ends, so the `csv` crate sees
/// empty lines there (which it skips) and keeps counting lines as in the file.
pub fn blank<'a>(text: &'a str, bad: &[BadQuote]) -> Cow<'a, str> {
    if bad.is_empty() {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len());
    let mut at = 0;
    for r in bad {
        // Ranges are in increasing order, start and end at ASCII bytes or the text's ends.
        out.push_str(&text[at..r.start]);
        out.extend(
            text[r.start..r.end]
                .chars()
                .filter(|&c| c == '\n' || c == '\r'),
        );
        at = r.end;
    }
    out.push_str(&text[at..]);
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(text: &str) -> Vec<usize> {
        find_bad_quotes(text, b',').iter().map(|b| b.line).collect()
    }

    #[test]
    fn well_formed_quotes_pass() {
        assert!(
            lines("a,b\n\"x, y\",\"multi\nline \"\"q\"\"\"\r\nplain \"inner\" quote,1\n")
                .is_empty()
        );
        assert!(lines("a,b\n\"\",\"\"\n\"last\"").is_empty());
        assert!(lines("\u{feff}\"a\",b\n1,2\n").is_empty());
    }

    #[test]
    fn unterminated_and_stray_quotes_cost_one_row() {
        let text = "a,b\n1,\"open\n2,ok\n3,\"x\" y\n4,\"fine\"\n";
        let bad = find_bad_quotes(text, b',');
        assert_eq!(bad.iter().map(|b| b.line).collect::<Vec<_>>(), [2, 4]);
        assert!(bad[1]
            .reason
            .contains("' ' after its closing quote on line 4"));
        assert_eq!(blank(text, &bad), "a,b\n\n2,ok\n\n4,\"fine\"\n");
        // Unterminated at the end of the file.
        let text = "a,b\r\n1,x\r\n2,\"open\r\nmore\r\n";
        let bad = find_bad_quotes(text, b',');
        assert_eq!(bad.len(), 1);
        assert_eq!(bad[0].line, 3);
        assert!(bad[0].reason.starts_with("unterminated"));
        assert_eq!(blank(text, &bad), "a,b\r\n1,x\r\n\r\nmore\r\n");
        // A bad header is reported as the first record.
        assert!(find_bad_quotes("\"a,b\n1,2\n", b',')[0].first_record);
    }
}
