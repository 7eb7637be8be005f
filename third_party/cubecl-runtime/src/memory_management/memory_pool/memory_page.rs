use crate::{
    memory_management::{
        BytesFormat, MemoryUsage, SliceHandle, SliceId,
        memory_pool::{Slice, calculate_padding},
    },
    storage::{StorageHandle, StorageUtilization},
};
use alloc::collections::BTreeMap;
use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;
use core::fmt::{Debug, Display};
use hashbrown::HashMap;

/// A memory page is responsible to reserve [slices](Slice) of data based on a fixed [storage buffer](StorageHandle).
///
/// kiln's patch (PATCHES.md): the slices live in a slab whose places do not move, indexed three
/// ways (by offset, by id and by effective size), so cutting a slice, merging free neighbours
/// and finding a binding's storage each touch only the slices concerned. Upstream kept one
/// vector in offset order and rebuilt a hash map of every slice's index after each cut and each
/// merge, which a host profile of kiln's training steps on an H200 found to be most of a step's
/// host time.
pub struct MemoryPage {
    storage: StorageHandle,
    /// Every slice of the page; `None` is a place free for the next new slice (`vacant`).
    slab: Vec<Option<Slice>>,
    vacant: Vec<usize>,
    /// The slices in offset order; together they cover the page.
    by_offset: BTreeMap<u64, usize>,
    /// Each slice's place by its id, for bindings.
    by_id: HashMap<SliceId, usize>,
    /// The places of the slices of each effective size (size plus padding).
    by_size: HashMap<u64, Vec<usize>>,
    /// Memory alignment.
    alignment: u64,
}

impl MemoryPage {
    /// Creates a new memory page with the given storage and memory alignment.
    pub fn new(storage: StorageHandle, alignment: u64) -> Self {
        let mut this = MemoryPage {
            storage: storage.clone(),
            slab: Vec::new(),
            vacant: Vec::new(),
            by_offset: BTreeMap::new(),
            by_id: HashMap::new(),
            by_size: HashMap::new(),
            alignment,
        };
        this.insert(Slice {
            handle: SliceHandle::new(),
            storage,
            padding: 0,
        });
        this
    }

    fn slice(&self, place: usize) -> &Slice {
        self.slab[place]
            .as_ref()
            .expect("an indexed place holds a slice")
    }

    fn slice_mut(&mut self, place: usize) -> &mut Slice {
        self.slab[place]
            .as_mut()
            .expect("an indexed place holds a slice")
    }

    /// The slices in offset order.
    fn ordered(&self) -> impl Iterator<Item = &Slice> {
        self.by_offset.values().map(|&place| self.slice(place))
    }

    fn insert(&mut self, slice: Slice) -> usize {
        let offset = slice.storage.offset();
        let size = slice.effective_size();
        let id = slice.id();
        let place = match self.vacant.pop() {
            Some(place) => {
                self.slab[place] = Some(slice);
                place
            }
            None => {
                self.slab.push(Some(slice));
                self.slab.len() - 1
            }
        };
        self.by_offset.insert(offset, place);
        self.by_id.insert(id, place);
        self.by_size.entry(size).or_default().push(place);
        place
    }

    fn remove(&mut self, place: usize) -> Slice {
        let slice = self.slab[place]
            .take()
            .expect("an indexed place holds a slice");
        self.vacant.push(place);
        self.by_offset.remove(&slice.storage.offset());
        self.by_id.remove(&slice.id());
        self.unlist_size(slice.effective_size(), place);
        slice
    }

    fn unlist_size(&mut self, size: u64, place: usize) {
        if let Some(places) = self.by_size.get_mut(&size) {
            places.retain(|&p| p != place);
            if places.is_empty() {
                self.by_size.remove(&size);
            }
        }
    }

    /// Gives the free slice at `place`, whose effective size is `size + padding`, to a new user.
    fn hand_out(&mut self, place: usize, size: u64, padding: u64) -> SliceHandle {
        let slice = self.slice_mut(place);
        slice.storage.utilization.size = size;
        slice.padding = padding;
        slice.handle.clone()
    }

    /// Gets the [memory usage](MemoryUsage) of the current memory page.
    pub fn memory_usage(&self) -> MemoryUsage {
        let mut usage = MemoryUsage {
            number_allocs: 0,
            bytes_in_use: 0,
            bytes_padding: 0,
            bytes_reserved: 0,
        };

        for slice in self.ordered() {
            usage.bytes_reserved += slice.effective_size();

            if !slice.handle.is_free() {
                usage.number_allocs += 1;
                usage.bytes_in_use += slice.storage.size();
                usage.bytes_padding += slice.padding;
            }
        }

        usage
    }

    /// Gets the [summary](MemoryPageSummary) of the current memory page.
    ///
    /// # Arguments
    ///
    /// - `memory_blocks`: whether the memory block details are included in the summary.
    pub fn summary(&self, memory_blocks: bool) -> MemoryPageSummary {
        let mut summary = MemoryPageSummary::default();

        for slice in self.ordered() {
            let is_free = slice.handle.is_free();
            if is_free {
                summary.amount_free += slice.effective_size();
                summary.num_free += 1;
            } else {
                summary.amount_full += slice.effective_size();
                summary.num_full += 1;
            }
            if memory_blocks {
                summary.blocks.push(MemoryBlock {
                    is_free,
                    size: slice.effective_size(),
                });
            }
        }
        summary.amount_total = self.storage.size();
        summary.num_total = self.by_offset.len();

        summary
    }

    /// Reuses a free slice whose effective size is exactly the padded `size`, whole: no cut, no
    /// merge, a look at the slices of that size only. A training step asks for the same sizes
    /// step after step, so after the first step most reservations end here.
    pub fn try_reserve_exact(&mut self, size: u64) -> Option<SliceHandle> {
        let padding = calculate_padding(size, self.alignment);
        let places = self.by_size.get(&(size + padding))?;
        let place = *places
            .iter()
            .find(|&&place| self.slice(place).handle.is_free())?;
        Some(self.hand_out(place, size, padding))
    }

    /// Reserves a slice of the given size if there is enough place in the page: the smallest
    /// free slice that holds it (the lowest offset among equals), cut to size.
    ///
    /// # Notes
    ///
    /// If the current memory page is fragmented, meaning multiple contiguous slices of data exist,
    /// you can call the [Self::coalesce()] function to merge those.
    #[cfg_attr(feature = "tracing", tracing::instrument(level = "trace", skip(self)))]
    pub fn try_reserve(&mut self, size: u64) -> Option<SliceHandle> {
        let padding = calculate_padding(size, self.alignment);
        let effective_size = size + padding;

        let mut best: Option<(u64, usize)> = None;
        for &place in self.by_offset.values() {
            let slice = self.slice(place);
            let have = slice.effective_size();
            if have < effective_size || best.is_some_and(|(b, _)| b <= have) {
                continue;
            }
            if slice.handle.is_free() {
                best = Some((have, place));
                if have == effective_size {
                    break;
                }
            }
        }
        let (have, place) = best?;

        if have > effective_size {
            // The rest of the slice becomes a free slice of its own, after it.
            self.unlist_size(have, place);
            self.by_size.entry(effective_size).or_default().push(place);
            let slice = self.slice(place);
            let rest = Slice {
                handle: SliceHandle::new(),
                storage: StorageHandle {
                    id: slice.storage.id,
                    utilization: StorageUtilization {
                        offset: slice.storage.offset() + effective_size,
                        size: have - effective_size,
                    },
                },
                padding: 0,
            };
            self.insert(rest);
        }

        Some(self.hand_out(place, size, padding))
    }

    /// Gets the [storage handle](SliceHandle) with the correct offset and size using the slice
    /// binding.
    ///
    /// If the handle isn't returned, it means the binding isn't present in the given page.
    pub fn get(&self, binding: &super::SliceBinding) -> Option<&StorageHandle> {
        let place = self.by_id.get(binding.id())?;
        self.slab[*place].as_ref().map(|slice| &slice.storage)
    }

    /// Merges each run of adjacent free slices into one free slice.
    ///
    /// This is necessary to allow bigger slices to be reserved on the current page.
    #[cfg_attr(feature = "tracing", tracing::instrument(level = "trace", skip(self)))]
    pub fn coalesce(&mut self) {
        let mut runs: Vec<Vec<usize>> = Vec::new();
        let mut run: Vec<usize> = Vec::new();
        for &place in self.by_offset.values() {
            if self.slice(place).handle.is_free() {
                run.push(place);
            } else if run.len() > 1 {
                runs.push(core::mem::take(&mut run));
            } else {
                run.clear();
            }
        }
        if run.len() > 1 {
            runs.push(run);
        }

        for run in runs {
            let offset = self.slice(run[0]).storage.offset();
            let size = run
                .into_iter()
                .map(|place| self.remove(place).effective_size())
                .sum();
            let mut storage = self.storage.clone();
            storage.utilization = StorageUtilization { offset, size };
            self.insert(Slice {
                handle: SliceHandle::new(),
                storage,
                padding: 0,
            });
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
struct MemoryBlock {
    is_free: bool,
    size: u64,
}

#[derive(Default, PartialEq, Eq)]
pub struct MemoryPageSummary {
    blocks: Vec<MemoryBlock>,
    pub amount_free: u64,
    pub amount_full: u64,
    pub amount_total: u64,
    pub num_free: usize,
    pub num_full: usize,
    pub num_total: usize,
}

impl Display for MemoryBlock {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self.is_free {
            true => f.write_fmt(format_args!("Free ({})", BytesFormat::new(self.size))),
            false => f.write_fmt(format_args!("Reserved ({})", BytesFormat::new(self.size))),
        }
    }
}
impl Display for MemoryPageSummary {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_fmt(format_args!("{self:?}"))
    }
}

impl Debug for MemoryPageSummary {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("\n==== Memory Page Summary ====\n")?;
        f.write_str("[Info]\n")?;

        for (tag, num, amount) in [
            ("Free ", self.num_free, self.amount_free),
            ("Full ", self.num_full, self.amount_full),
            ("Total", self.num_total, self.amount_total),
        ] {
            f.write_fmt(format_args!(
                " - {tag}: {} slices ({})\n",
                num,
                BytesFormat::new(amount),
            ))?;
        }

        f.write_str("\n[Blocks]\n")?;
        let mut blocks = String::new();
        for (i, b) in self.blocks.iter().enumerate() {
            if i == 0 {
                blocks += "|";
            }
            blocks += format!(" {b} |").as_str();
        }
        let size = blocks.len();
        for _ in 0..size {
            f.write_str("-")?;
        }
        f.write_str("\n")?;
        f.write_str(&blocks)?;
        f.write_str("\n")?;
        for _ in 0..size {
            f.write_str("-")?;
        }

        f.write_str("\n=============================")?;
        f.write_str("\n")
    }
}

impl Display for MemoryPage {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_fmt(format_args!("{}", self.summary(true)))
    }
}

#[cfg(test)]
#[allow(clippy::bool_assert_comparison, clippy::identity_op)]
mod tests {
    use crate::storage::{StorageId, StorageUtilization};

    use super::*;

    const MB: u64 = 1024 * 1024;

    #[test_log::test]
    fn test_memory_page() {
        let mut page = new_memory_page(32 * MB);
        let slice = page
            .try_reserve(16 * MB)
            .expect("Enough space to allocate a new slice");

        assert_eq!(slice.is_free(), false);
        assert_eq!(slice.can_mut(), true);

        let storage = page
            .get(&slice.binding())
            .expect("To find the correct storage");

        assert_eq!(
            storage.utilization,
            StorageUtilization {
                offset: 0,
                size: 16 * MB
            },
            "Utilization to be correct"
        );

        let summary = page.summary(true);

        assert_eq!(
            summary,
            MemoryPageSummary {
                blocks: vec![
                    MemoryBlock {
                        is_free: true,
                        size: 16 * MB
                    },
                    MemoryBlock {
                        is_free: true,
                        size: 16 * MB
                    }
                ],
                amount_free: 32 * MB,
                amount_full: 0,
                amount_total: 32 * MB,
                num_free: 2,
                num_full: 0,
                num_total: 2
            },
            "Summary is correct before coalesce",
        );
        page.coalesce();
        let summary = page.summary(true);

        assert_eq!(
            summary,
            MemoryPageSummary {
                blocks: vec![MemoryBlock {
                    is_free: true,
                    size: 32 * MB
                },],
                amount_free: 32 * MB,
                amount_full: 0,
                amount_total: 32 * MB,
                num_free: 1,
                num_full: 0,
                num_total: 1
            },
            "Summary is correct after coalesce",
        );
    }

    #[test_log::test]
    fn a_freed_slice_merges_with_the_free_rest() {
        let mut page = new_memory_page(32 * MB);
        let slice = page
            .try_reserve(16 * MB)
            .expect("Enough space to allocate a new slice");
        assert_eq!(page.summary(false).num_total, 2);

        core::mem::drop(slice);
        page.coalesce();
        let summary = page.summary(true);
        assert_eq!(
            summary.blocks,
            vec![MemoryBlock {
                is_free: true,
                size: 32 * MB
            }]
        );
        assert!(page.try_reserve(32 * MB).is_some());
    }

    #[test_log::test]
    fn a_slice_of_the_same_padded_size_is_reused_whole() {
        let mut page = new_memory_page(32 * MB);
        let a = page.try_reserve(6).unwrap();
        let b = page.try_reserve(8).unwrap();
        let a_at = page.get(&a.clone().binding()).unwrap().utilization.clone();
        core::mem::drop(a);
        assert!(page.try_reserve_exact(9).is_none(), "12 bytes: no slice");
        let c = page.try_reserve_exact(5).expect("5 pads to 8, as 6 did");
        let c_at = page.get(&c.clone().binding()).unwrap().utilization.clone();
        assert_eq!(
            c_at,
            StorageUtilization {
                offset: a_at.offset,
                size: 5
            }
        );
        assert_eq!(page.summary(false).num_total, 3, "no cut, no new slice");
        assert!(page.try_reserve_exact(8).is_none(), "b and c are in use");
        core::mem::drop(b);
    }

    #[test_log::test]
    fn the_smallest_free_slice_that_fits_is_cut() {
        let mut page = new_memory_page(32 * MB);
        let a = page.try_reserve(8 * MB).unwrap();
        let _b = page.try_reserve(MB).unwrap();
        let c = page.try_reserve(4 * MB).unwrap();
        let _d = page.try_reserve(MB).unwrap();
        core::mem::drop(a);
        core::mem::drop(c);
        // Free: 8 MB at 0, 4 MB at 9 MB, 18 MB at 14 MB.
        let e = page.try_reserve(3 * MB).unwrap();
        let at = page.get(&e.clone().binding()).unwrap().utilization.clone();
        assert_eq!(
            at,
            StorageUtilization {
                offset: 9 * MB,
                size: 3 * MB
            }
        );
    }

    /// Random reservations and releases against a model of the page: every slice handed out
    /// lies inside the page, aligned, apart from every other live one; the slices always tile
    /// the page; a binding finds its own bytes; and after a merge, a reservation that fits in
    /// some run of free bytes succeeds.
    #[test_log::test]
    fn random_reservations_keep_the_page_whole() {
        use rand::{Rng, SeedableRng, rngs::StdRng};

        let page_size = 4096;
        let mut rng = StdRng::seed_from_u64(7);
        for round in 0..40 {
            let mut page = new_memory_page(page_size);
            let mut live: Vec<(SliceHandle, u64)> = Vec::new();
            for _ in 0..400 {
                if !live.is_empty() && rng.random_bool(0.45) {
                    let at = rng.random_range(0..live.len());
                    live.swap_remove(at);
                    continue;
                }
                let size = match rng.random_range(0..3) {
                    0 => rng.random_range(1..16),
                    1 => 4 * rng.random_range(1..32),
                    _ => rng.random_range(1..700),
                };
                let got = match rng.random_range(0..3) {
                    0 => page.try_reserve_exact(size),
                    1 => page.try_reserve(size),
                    _ => {
                        page.coalesce();
                        let largest_run = free_runs(&page).into_iter().max().unwrap_or(0);
                        let got = page.try_reserve(size);
                        let padded = size + calculate_padding(size, 4);
                        assert_eq!(got.is_some(), padded <= largest_run, "round {round}");
                        got
                    }
                };
                if let Some(handle) = got {
                    live.push((handle, size));
                }
                check(&page, &live, page_size);
            }
            live.clear();
            page.coalesce();
            assert_eq!(page.summary(false).num_total, 1, "all free merges into one");
        }
    }

    fn free_runs(page: &MemoryPage) -> Vec<u64> {
        let mut runs = Vec::new();
        let mut run = 0;
        for slice in page.ordered() {
            if slice.handle.is_free() {
                run += slice.effective_size();
            } else if run > 0 {
                runs.push(core::mem::take(&mut run));
            }
        }
        runs.push(run);
        runs
    }

    fn check(page: &MemoryPage, live: &[(SliceHandle, u64)], page_size: u64) {
        let mut end = 0;
        for slice in page.ordered() {
            assert_eq!(slice.storage.offset(), end, "slices tile the page");
            assert_eq!(slice.storage.offset() % 4, 0, "aligned");
            end += slice.effective_size();
        }
        assert_eq!(end, page_size);
        let mut spans: Vec<(u64, u64)> = live
            .iter()
            .map(|(handle, size)| {
                let storage = page.get(&handle.clone().binding()).expect("a live binding");
                assert_eq!(storage.size(), *size);
                (storage.offset(), storage.offset() + size)
            })
            .collect();
        spans.sort();
        for pair in spans.windows(2) {
            assert!(pair[0].1 <= pair[1].0, "live slices overlap: {pair:?}");
        }
        assert_eq!(page.by_id.len(), page.by_offset.len());
        let indexed: usize = page.by_size.values().map(Vec::len).sum();
        assert_eq!(indexed, page.by_offset.len());
    }

    #[test_log::test]
    fn test_scenario() {
        let mut page = new_memory_page(32 * MB);

        let slice_1 = page
            .try_reserve(4 * MB)
            .expect("Enough space to allocate a new slice");
        let slice_2 = page
            .try_reserve(15 * MB)
            .expect("Enough space to allocate a new slice");
        let slice_3 = page
            .try_reserve(8 * MB)
            .expect("Enough space to allocate a new slice");
        let slice_4 = page
            .try_reserve(4 * MB)
            .expect("Enough space to allocate a new slice");

        assert_eq!(
            page.summary(true),
            MemoryPageSummary {
                blocks: vec![
                    MemoryBlock {
                        is_free: false,
                        size: 4 * MB
                    },
                    MemoryBlock {
                        is_free: false,
                        size: 15 * MB
                    },
                    MemoryBlock {
                        is_free: false,
                        size: 8 * MB
                    },
                    MemoryBlock {
                        is_free: false,
                        size: 4 * MB
                    },
                    MemoryBlock {
                        is_free: true,
                        size: 1 * MB
                    }
                ],
                amount_free: 1 * MB,
                amount_full: 31 * MB,
                amount_total: 32 * MB,
                num_free: 1,
                num_full: 4,
                num_total: 5
            },
        );

        let slice_5 = page.try_reserve(8 * MB);
        assert!(slice_5.is_none(), "No more place");

        core::mem::drop(slice_2);
        let slice_5 = page.try_reserve(9 * MB);
        assert!(slice_5.is_some(), "Now we have more place");

        let slice_6 = page.try_reserve(9 * MB);
        assert!(slice_6.is_none(), "No more place");

        core::mem::drop(slice_3);
        let slice_6 = page.try_reserve(9 * MB);
        assert!(slice_6.is_none(), "No more place");

        page.coalesce();

        assert_eq!(
            page.summary(true),
            MemoryPageSummary {
                blocks: vec![
                    MemoryBlock {
                        is_free: false,
                        size: 4 * MB
                    },
                    MemoryBlock {
                        is_free: false,
                        size: 9 * MB
                    },
                    MemoryBlock {
                        is_free: true,
                        size: 14 * MB
                    },
                    MemoryBlock {
                        is_free: false,
                        size: 4 * MB
                    },
                    MemoryBlock {
                        is_free: true,
                        size: 1 * MB
                    }
                ],
                amount_free: 15 * MB,
                amount_full: 17 * MB,
                amount_total: 32 * MB,
                num_free: 2,
                num_full: 3,
                num_total: 5
            },
        );

        assert_eq!(
            page.get(&slice_4.clone().binding()).unwrap().utilization,
            StorageUtilization {
                offset: 27 * MB,
                size: 4 * MB
            },
            "Utilization to be correct"
        );

        let slice_6 = page.try_reserve(9 * MB);
        assert!(slice_6.is_some(), "Now we have more place");
        core::mem::drop(slice_1);
        core::mem::drop(slice_4);

        page.coalesce();

        assert_eq!(
            page.get(&slice_6.clone().unwrap().binding())
                .unwrap()
                .utilization,
            StorageUtilization {
                offset: 13 * MB,
                size: 9 * MB
            },
            "Utilization to be correct"
        );

        assert_eq!(
            page.summary(true),
            MemoryPageSummary {
                blocks: vec![
                    MemoryBlock {
                        is_free: true,
                        size: 4 * MB
                    },
                    MemoryBlock {
                        is_free: false,
                        size: 9 * MB
                    },
                    MemoryBlock {
                        is_free: false,
                        size: 9 * MB
                    },
                    MemoryBlock {
                        is_free: true,
                        size: 10 * MB
                    }
                ],
                amount_free: 14 * MB,
                amount_full: 18 * MB,
                amount_total: 32 * MB,
                num_free: 2,
                num_full: 2,
                num_total: 4
            },
        );
    }

    fn new_memory_page(size: u64) -> MemoryPage {
        let storage = StorageHandle::new(StorageId::new(), StorageUtilization { offset: 0, size });

        MemoryPage::new(storage, 4)
    }
}
