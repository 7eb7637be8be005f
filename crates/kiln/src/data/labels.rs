//! Label names ↔ class ids.

use std::collections::{BTreeSet, HashMap};

/// The ordered set of class labels; a label's id is its position.
///
/// Labels are strings or integers, as `datasets.ClassLabel` takes them. A CSV field is always text,
/// but pandas and `datasets` read a label column whose every value is an integer as integers, so
/// such a set is an integer set: `01`, `+1` and `1` are the same class `1`, in training and eval
/// files alike. If any label is not an integer, labels are compared verbatim.
#[derive(Debug, Clone, PartialEq)]
pub struct LabelSet {
    names: Vec<String>,
    index: HashMap<String, usize>,
    /// Ids by integer value, when every name is an integer.
    by_int: Option<HashMap<i64, usize>>,
}

impl LabelSet {
    pub fn new(names: Vec<String>) -> Self {
        let index = names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.clone(), i))
            .collect();
        let by_int = names
            .iter()
            .enumerate()
            .map(|(i, n)| n.parse::<i64>().ok().map(|v| (v, i)))
            .collect();
        Self {
            names,
            index,
            by_int,
        }
    }

    /// The distinct labels of a training set in a stable order: numeric order when every label is an
    /// integer (so `0..n` labels keep their ids, named in canonical decimal), lexicographic otherwise
    /// (as `sorted(set(labels))`).
    pub fn infer<'a>(labels: impl IntoIterator<Item = &'a str>) -> Self {
        let distinct: BTreeSet<&str> = labels.into_iter().collect();
        let ints: Option<BTreeSet<i64>> = distinct.iter().map(|n| n.parse().ok()).collect();
        let names = match ints {
            Some(ints) => ints.iter().map(i64::to_string).collect(),
            None => distinct.into_iter().map(str::to_string).collect(),
        };
        Self::new(names)
    }

    /// The id of a label: verbatim, or by integer value in an integer set.
    pub fn id(&self, name: &str) -> Option<usize> {
        if let Some(&i) = self.index.get(name) {
            return Some(i);
        }
        let v = name.parse::<i64>().ok()?;
        self.by_int.as_ref()?.get(&v).copied()
    }

    pub fn names(&self) -> &[String] {
        &self.names
    }

    pub fn len(&self) -> usize {
        self.names.len()
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_labels_are_one_class_per_value() {
        let l = LabelSet::infer(["10", "01", "+1", "1", "2", "-3"]);
        assert_eq!(l.names(), ["-3", "1", "2", "10"]);
        assert_eq!(l.id("001"), Some(1));
        assert_eq!(l.id("+10"), Some(3));
        assert_eq!(l.id("1.0"), None);
        assert_eq!(l.id("4"), None);
    }

    #[test]
    fn one_string_label_keeps_all_verbatim() {
        let l = LabelSet::infer(["1", "01", "x"]);
        assert_eq!(l.names(), ["01", "1", "x"]);
        assert_eq!(l.id("01"), Some(0));
        assert_eq!(l.id("+1"), None);
    }
}
