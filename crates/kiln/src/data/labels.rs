//! Label names ↔ class ids.

use std::collections::HashMap;

/// The ordered set of class labels; a label's id is its position.
#[derive(Debug, Clone, PartialEq)]
pub struct LabelSet {
    names: Vec<String>,
    index: HashMap<String, usize>,
}

impl LabelSet {
    pub fn new(names: Vec<String>) -> Self {
        let index = names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.clone(), i))
            .collect();
        Self { names, index }
    }

    /// The distinct labels of a training set in a stable order: numeric order when every label is an
    /// integer (so `0..n` labels keep their ids), lexicographic otherwise (as `sorted(set(labels))`).
    pub fn infer<'a>(labels: impl IntoIterator<Item = &'a str>) -> Self {
        let mut names: Vec<String> = labels
            .into_iter()
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .map(str::to_string)
            .collect();
        if names.iter().all(|n| n.parse::<i64>().is_ok()) {
            names.sort_by_key(|n| n.parse::<i64>().unwrap_or(0));
        }
        Self::new(names)
    }

    pub fn id(&self, name: &str) -> Option<usize> {
        self.index.get(name).copied()
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
