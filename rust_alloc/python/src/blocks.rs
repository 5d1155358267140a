//! `edgepaged._native.blocks`: the block pool as `BlockAllocator`. Errors become Python
//! exceptions; no panic crosses into Python (PyO3 turns one into `PanicException`, and the
//! core validates before it acts).

use numpy::{IntoPyArray, PyArrayMethods, PyReadonlyArray1};
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use block_pool::{AllocError, BlockPool};

create_exception!(blocks, AllocatorError, PyException, "Base class of the allocator's errors.");
create_exception!(blocks, NoFreeBlocksError, AllocatorError, "Not enough free KV blocks; nothing changed.");
create_exception!(blocks, SequenceError, AllocatorError, "Unknown or duplicate sequence id, or a request the sequence cannot honour.");

fn err(e: AllocError) -> PyErr {
    let msg = e.to_string();
    match e {
        AllocError::NoFreeBlocks { .. } => NoFreeBlocksError::new_err(msg),
        AllocError::UnknownSequence(_) | AllocError::DuplicateSequence(_) | AllocError::Sequence(_) => {
            SequenceError::new_err(msg)
        }
        AllocError::Invalid(_) => PyValueError::new_err(msg),
    }
}

/// Integers from a 1-D numpy array (int64 or int32) or any sequence of ints.
fn ints(obj: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    if let Ok(a) = obj.extract::<PyReadonlyArray1<i64>>() {
        return Ok(a.as_slice().map(|s| s.to_vec()).unwrap_or_else(|_| a.as_array().to_vec()));
    }
    if let Ok(a) = obj.extract::<PyReadonlyArray1<i32>>() {
        return Ok(a.as_array().iter().map(|&x| x as i64).collect());
    }
    obj.extract::<Vec<i64>>()
        .map_err(|_| PyValueError::new_err("expected a 1-D sequence or numpy array of integers"))
}

fn token_ids(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    ints(obj)?
        .into_iter()
        .map(|t| {
            u32::try_from(t)
                .ok()
                .filter(|&t| t != u32::MAX)
                .ok_or_else(|| PyValueError::new_err(format!("token id {t} out of range")))
        })
        .collect()
}

/// A fixed pool of KV-cache blocks with refcounts, copy-on-write, a prefix cache and
/// per-sequence block tables. See docs/INTERNALS.md.
#[pyclass(module = "edgepaged._native.blocks")]
pub struct BlockAllocator {
    pool: BlockPool,
}

#[pymethods]
impl BlockAllocator {
    #[new]
    #[pyo3(signature = (num_blocks, block_size, enable_prefix_caching = true, contiguous = false, pick_window = None))]
    fn new(num_blocks: usize, block_size: usize, enable_prefix_caching: bool, contiguous: bool,
           pick_window: Option<usize>) -> PyResult<Self> {
        let mut pool = BlockPool::new(num_blocks, block_size, enable_prefix_caching, contiguous).map_err(err)?;
        if let Some(w) = pick_window {
            pool.set_pick_window(w);
        }
        Ok(BlockAllocator { pool })
    }

    /// How many of the least recently freed blocks a sequence's next block is chosen among.
    #[getter]
    fn pick_window(&self) -> usize { self.pool.pick_window() }

    #[getter]
    fn num_blocks(&self) -> usize { self.pool.num_blocks() }
    #[getter]
    fn block_size(&self) -> usize { self.pool.block_size() }
    #[getter]
    fn num_free_blocks(&self) -> usize { self.pool.num_free_blocks() }
    #[getter]
    fn num_used_blocks(&self) -> usize { self.pool.num_used_blocks() }
    #[getter]
    fn num_cached_blocks(&self) -> usize { self.pool.num_cached_blocks() }
    #[getter]
    fn num_sequences(&self) -> usize { self.pool.num_sequences() }
    #[getter]
    fn enable_prefix_caching(&self) -> bool { self.pool.prefix_caching() }
    #[getter]
    fn contiguous(&self) -> bool { self.pool.contiguous() }

    #[pyo3(signature = (seq_id, prompt, salt = 0, reserve_tokens = None, partial = false))]
    fn add_sequence(&mut self, seq_id: i64, prompt: &Bound<'_, PyAny>, salt: u64, reserve_tokens: Option<usize>,
                    partial: bool) -> PyResult<usize> {
        let tokens = token_ids(prompt)?;
        self.pool.add_sequence_with(seq_id, tokens, salt, reserve_tokens, partial).map_err(err)
    }

    fn append_tokens(&mut self, seq_id: i64, tokens: &Bound<'_, PyAny>) -> PyResult<()> {
        let tokens = token_ids(tokens)?;
        self.pool.append_tokens(seq_id, &tokens).map_err(err)
    }

    /// A token learned after its slot was reserved (look-ahead decode): see `BlockPool::set_token`.
    fn set_token(&mut self, seq_id: i64, position: usize, token: i64) -> PyResult<()> {
        if !(0..u32::MAX as i64).contains(&token) {
            return Err(PyValueError::new_err(format!("token id {token} out of range")));
        }
        self.pool.set_token(seq_id, position, token as u32).map_err(err)
    }

    fn fork(&mut self, parent_id: i64, child_id: i64) -> PyResult<()> {
        self.pool.fork(parent_id, child_id).map_err(err)
    }

    #[pyo3(signature = (seq_id, cache = true, tail = false))]
    fn free_sequence(&mut self, seq_id: i64, cache: bool, tail: bool) -> PyResult<()> {
        self.pool.free_sequence_with(seq_id, cache, tail).map_err(err)
    }

    fn has_sequence(&self, seq_id: i64) -> bool { self.pool.sequence(seq_id).is_ok() }

    fn blocks_needed(&self, seq_id: i64, num_new_tokens: usize) -> PyResult<usize> {
        self.pool.blocks_needed(seq_id, num_new_tokens).map_err(err)
    }

    /// Blocks admitting a sequence with this prompt and a first step of `new_tokens` tokens
    /// takes from the pool (`add_sequence`, then `prepare_step`); changes nothing.
    #[pyo3(signature = (prompt, salt = 0, new_tokens = 0, reserve_tokens = None, partial = false))]
    fn admission_blocks(&self, prompt: &Bound<'_, PyAny>, salt: u64, new_tokens: usize,
                        reserve_tokens: Option<usize>, partial: bool) -> PyResult<usize> {
        Ok(self.pool.admission_blocks_with(&token_ids(prompt)?, salt, new_tokens, reserve_tokens, partial))
    }

    fn can_allocate(&self, num_blocks: usize) -> bool { num_blocks <= self.pool.num_free_blocks() }

    #[pyo3(signature = (prompt, salt = 0))]
    fn prefix_match(&self, prompt: &Bound<'_, PyAny>, salt: u64) -> PyResult<(usize, usize)> {
        Ok(self.pool.prefix_match(&token_ids(prompt)?, salt))
    }

    #[pyo3(signature = (prompt, salt = 0))]
    fn num_cached_prefix_tokens(&self, prompt: &Bound<'_, PyAny>, salt: u64) -> PyResult<usize> {
        Ok(self.pool.prefix_match(&token_ids(prompt)?, salt).0)
    }

    /// Reserve slots for this step; returns (slot_mapping, block_tables, seq_lens, copies,
    /// num_free_blocks): the step's arrays and the free blocks left after it, so a scheduler
    /// needs no other call to plan the next step.
    #[allow(clippy::type_complexity)]
    #[pyo3(signature = (seq_ids, num_new_tokens, new_tokens = None))]
    fn prepare_step<'py>(
        &mut self,
        py: Python<'py>,
        seq_ids: &Bound<'py, PyAny>,
        num_new_tokens: &Bound<'py, PyAny>,
        new_tokens: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>, Bound<'py, PyAny>, Bound<'py, PyAny>, usize)> {
        let ids = ints(seq_ids)?;
        let n = ints(num_new_tokens)?;
        let new_tokens = new_tokens.map(ints).transpose()?;
        let plan = self.pool.prepare_step(&ids, &n, new_tokens.as_deref()).map_err(err)?;
        let b = plan.seq_lens.len();
        let k = plan.copies.len();
        let copies: Vec<i32> = plan.copies.iter().flat_map(|&(s, d)| [s as i32, d as i32]).collect();
        Ok((
            plan.slot_mapping.into_pyarray(py).into_any(),
            plan.block_tables.into_pyarray(py).reshape([b, plan.width])?.into_any(),
            plan.seq_lens.into_pyarray(py).into_any(),
            copies.into_pyarray(py).reshape([k, 2])?.into_any(),
            self.pool.num_free_blocks(),
        ))
    }

    /// The window policy: release the blocks no later query of the sequence attends.
    fn release_outside(&mut self, seq_id: i64, sink_tokens: usize, window_tokens: usize) -> PyResult<usize> {
        self.pool.release_outside(seq_id, sink_tokens, window_tokens).map_err(err)
    }
    /// Speculation's rollback: keep the first `num_tokens` tokens of the sequence.
    fn truncate(&mut self, seq_id: i64, num_tokens: i64) -> PyResult<usize> {
        self.pool.truncate(seq_id, usize::try_from(num_tokens).unwrap_or(0)).map_err(err)
    }
    /// An interrupted step's undo: the sequence goes back to `num_tokens` tokens and
    /// `num_slots` slots (what it had before the step).
    fn undo_step(&mut self, seq_id: i64, num_tokens: i64, num_slots: i64) -> PyResult<usize> {
        let n = |x: i64| usize::try_from(x).map_err(|_| PyValueError::new_err(format!("negative count {x}")));
        self.pool.undo_step(seq_id, n(num_tokens)?, n(num_slots)?).map_err(err)
    }
    fn seq_num_released(&self, seq_id: i64) -> PyResult<usize> {
        Ok(self.pool.sequence(seq_id).map_err(err)?.released)
    }
    fn block_table(&self, seq_id: i64) -> PyResult<Vec<u32>> {
        Ok(self.pool.sequence(seq_id).map_err(err)?.blocks.clone())
    }
    fn seq_num_slots(&self, seq_id: i64) -> PyResult<usize> {
        Ok(self.pool.sequence(seq_id).map_err(err)?.num_slots)
    }
    fn seq_num_tokens(&self, seq_id: i64) -> PyResult<usize> {
        Ok(self.pool.sequence(seq_id).map_err(err)?.tokens.len())
    }
    fn seq_tokens(&self, seq_id: i64) -> PyResult<Vec<u32>> {
        Ok(self.pool.sequence(seq_id).map_err(err)?.tokens.clone())
    }
    fn seq_ids(&self) -> Vec<i64> { self.pool.seq_ids() }
    fn refcount(&self, block_id: usize) -> PyResult<u32> { self.pool.refcount(block_id).map_err(err) }
    fn is_cached(&self, block_id: usize) -> bool { self.pool.is_cached(block_id) }
    fn free_list(&self) -> Vec<u32> { self.pool.free_list() }

    /// Raise AssertionError if an internal invariant does not hold (for tests).
    fn check_invariants(&self) -> PyResult<()> {
        self.pool.check_invariants().map_err(pyo3::exceptions::PyAssertionError::new_err)
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        let c = self.pool.counters();
        d.set_item("num_blocks", self.pool.num_blocks())?;
        d.set_item("block_size", self.pool.block_size())?;
        d.set_item("free_blocks", self.pool.num_free_blocks())?;
        d.set_item("used_blocks", self.pool.num_used_blocks())?;
        d.set_item("cached_blocks", self.pool.num_cached_blocks())?;
        d.set_item("num_sequences", self.pool.num_sequences())?;
        d.set_item("prefix_cache_queries", c.prefix_cache_queries)?;
        d.set_item("prefix_cache_hits", c.prefix_cache_hits)?;
        d.set_item("evictions", c.evictions)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!(
            "BlockAllocator(num_blocks={}, block_size={}, free={}, used={}, cached={}, sequences={})",
            self.pool.num_blocks(),
            self.pool.block_size(),
            self.pool.num_free_blocks(),
            self.pool.num_used_blocks(),
            self.pool.num_cached_blocks(),
            self.pool.num_sequences()
        )
    }
}

pub(crate) fn module(py: Python<'_>) -> PyResult<Bound<'_, PyModule>> {
    let m = PyModule::new(py, "blocks")?;
    m.add_class::<BlockAllocator>()?;
    m.add("AllocatorError", py.get_type::<AllocatorError>())?;
    m.add("NoFreeBlocksError", py.get_type::<NoFreeBlocksError>())?;
    m.add("SequenceError", py.get_type::<SequenceError>())?;
    Ok(m)
}
