//! Classification metrics: accuracy, precision/recall/F1 per class, macro and weighted F1
//! (scikit-learn's definitions, zero where undefined), and the confusion matrix.

use serde::Serialize;

/// Logits and true labels of an evaluation, for built-in and user-supplied metrics.
#[derive(Debug, Clone, Default)]
pub struct Predictions {
    /// `[n][num_labels]`.
    pub logits: Vec<Vec<f32>>,
    pub labels: Vec<usize>,
}

impl Predictions {
    pub fn predicted(&self) -> Vec<usize> {
        self.logits.iter().map(|row| argmax(row)).collect()
    }
}

pub fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ClassReport {
    pub label: String,
    pub precision: f64,
    pub recall: f64,
    pub f1: f64,
    pub support: usize,
}

/// Above this many classes the confusion matrix (C² counts: 80 GB at 100,000 classes) is not
/// kept; only its [`TOP_CONFUSIONS`] largest off-diagonal cells are.
pub const MAX_CONFUSION_CLASSES: usize = 1000;

/// How many (true, predicted) confusions a report keeps above [`MAX_CONFUSION_CLASSES`].
pub const TOP_CONFUSIONS: usize = 20;

/// One cell of the confusion matrix: how many examples of class `truth` were predicted as
/// `predicted`.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Confusion {
    pub truth: usize,
    pub predicted: usize,
    pub count: usize,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ClassificationReport {
    pub accuracy: f64,
    pub f1_macro: f64,
    pub f1_weighted: f64,
    pub per_class: Vec<ClassReport>,
    /// `confusion[true][predicted]`, up to [`MAX_CONFUSION_CLASSES`] classes; `None` above.
    pub confusion: Option<Vec<Vec<usize>>>,
    /// Above [`MAX_CONFUSION_CLASSES`]: the largest off-diagonal cells, largest first.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub top_confusions: Vec<Confusion>,
}

/// Per-class metrics in O(classes + examples): each class's hits, support and predictions are
/// counted as the examples stream by, so memory never grows with classes².
pub fn classification_report(
    truth: &[usize],
    predicted: &[usize],
    label_names: &[String],
) -> ClassificationReport {
    let n = label_names.len();
    let (mut hits, mut support, mut predicted_as) =
        (vec![0usize; n], vec![0usize; n], vec![0usize; n]);
    let mut cells: std::collections::HashMap<(usize, usize), usize> = Default::default();
    for (&t, &p) in truth.iter().zip(predicted) {
        support[t] += 1;
        predicted_as[p] += 1;
        if t == p {
            hits[t] += 1;
        }
        // Nonzero cells only: at most one per example.
        *cells.entry((t, p)).or_default() += 1;
    }
    let total = truth.len().max(1) as f64;
    let correct: usize = hits.iter().sum();
    let ratio = |a: usize, b: usize| if b > 0 { a as f64 / b as f64 } else { 0.0 };
    let per_class: Vec<ClassReport> = (0..n)
        .map(|c| {
            let precision = ratio(hits[c], predicted_as[c]);
            let recall = ratio(hits[c], support[c]);
            let f1 = if precision + recall > 0.0 {
                2.0 * precision * recall / (precision + recall)
            } else {
                0.0
            };
            ClassReport {
                label: label_names[c].clone(),
                precision,
                recall,
                f1,
                support: support[c],
            }
        })
        .collect();
    let f1_macro = per_class.iter().map(|c| c.f1).sum::<f64>() / n.max(1) as f64;
    let f1_weighted = per_class
        .iter()
        .map(|c| c.f1 * c.support as f64)
        .sum::<f64>()
        / total;
    let (confusion, top_confusions) = if n <= MAX_CONFUSION_CLASSES {
        let mut m = vec![vec![0usize; n]; n];
        for (&(t, p), &count) in &cells {
            m[t][p] = count;
        }
        (Some(m), Vec::new())
    } else {
        let mut top: Vec<Confusion> = cells
            .into_iter()
            .filter(|((t, p), _)| t != p)
            .map(|((truth, predicted), count)| Confusion {
                truth,
                predicted,
                count,
            })
            .collect();
        top.sort_by(|a, b| {
            b.count
                .cmp(&a.count)
                .then((a.truth, a.predicted).cmp(&(b.truth, b.predicted)))
        });
        top.truncate(TOP_CONFUSIONS);
        (None, top)
    };
    ClassificationReport {
        accuracy: correct as f64 / total,
        f1_macro,
        f1_weighted,
        per_class,
        confusion,
        top_confusions,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_scikit_learn_on_a_small_case() {
        // sklearn.metrics.f1_score([0,0,1,1,2,2,2],[0,1,1,1,2,0,2], average=...) →
        // macro 0.7, weighted 0.7142857; accuracy 5/7.
        let names: Vec<String> = ["a", "b", "c"].iter().map(|s| s.to_string()).collect();
        let r = classification_report(&[0, 0, 1, 1, 2, 2, 2], &[0, 1, 1, 1, 2, 0, 2], &names);
        assert!((r.accuracy - 5.0 / 7.0).abs() < 1e-12);
        assert!((r.f1_macro - 0.7).abs() < 1e-9, "{}", r.f1_macro);
        assert!(
            (r.f1_weighted - 0.714_285_714_3).abs() < 1e-9,
            "{}",
            r.f1_weighted
        );
        assert_eq!(
            r.confusion,
            Some(vec![vec![1, 1, 0], vec![0, 2, 0], vec![1, 0, 2]])
        );
    }

    /// 100,000 classes (the confusion matrix would be 80 GB): per-class metrics as with few
    /// classes, only the largest confusions kept.
    #[test]
    fn many_classes_keep_only_the_top_confusions() {
        let n = 100_000;
        let names: Vec<String> = (0..n).map(|c| c.to_string()).collect();
        // Class c is predicted right, except that 3 of class 7 are taken for 9 and 1 of 8 for 2.
        let mut truth: Vec<usize> = (0..n).collect();
        let mut pred = truth.clone();
        truth.extend([7, 7, 7, 8]);
        pred.extend([9, 9, 9, 2]);
        let r = classification_report(&truth, &pred, &names);
        assert!(r.confusion.is_none());
        assert_eq!(
            r.top_confusions,
            vec![
                Confusion {
                    truth: 7,
                    predicted: 9,
                    count: 3
                },
                Confusion {
                    truth: 8,
                    predicted: 2,
                    count: 1
                },
            ]
        );
        assert_eq!(r.per_class[7].support, 4);
        assert!((r.per_class[7].recall - 0.25).abs() < 1e-12);
        assert!((r.per_class[9].precision - 0.25).abs() < 1e-12);
        assert!((r.accuracy - n as f64 / (n + 4) as f64).abs() < 1e-12);
    }
}
