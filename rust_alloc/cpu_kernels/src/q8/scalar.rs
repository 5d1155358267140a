//! The portable integer product: the same integers and the same float operations, in the
//! same order, as the SIMD paths (`f32::mul_add` is a fused multiply-add, correctly rounded).

use super::{code_at, group_ab, Out, QAct, RMatrix, ROWS};
use crate::quant::QType;

/// Row groups `g0..g1` of `w` against every token of `a`.
///
/// # Safety
/// `o` must hold `a.tokens` rows with room for the columns of these row groups.
pub(crate) unsafe fn rows(w: &RMatrix, a: &QAct, o: Out, g0: usize, g1: usize) {
    let l = &w.layout;
    let (kind, nb, q6) = (l.codes(), l.groups(), l.qtype == QType::Q6_K);
    // K-quants: a superblock's 8 groups summed without the activations' scale (`a.sb`)
    let sbg = l.act_groups();
    for rgi in g0..g1 {
        let rg = w.rg(rgi);
        let nr = (l.rows - rgi * ROWS).min(ROWS);
        for t in 0..a.tokens {
            let mut acc = [0f32; ROWS];
            for sbi in 0..nb / sbg {
                let mut sum = [0f32; ROWS];
                for g in sbg * sbi..sbg * (sbi + 1) {
                    let (at, _) = l.group_at(g);
                    let ai = a.at(t, g);
                    let qx = &a.q[32 * ai..32 * ai + 32];
                    let cb = &rg[at..at + l.code_bytes()];
                    for r in 0..ROWS {
                        let mut i = [0i32; 2];
                        for k in 0..32 {
                            i[k / 16] += code_at(kind, cb, r, k) as i32 * qx[k] as i32;
                        }
                        let ab = group_ab(l, rg, g, r);
                        if sbg > 1 {
                            let s = &mut sum[r];
                            if q6 {
                                for h in 0..2 {
                                    *s = ab[h].0.mul_add((i[h] - a.k16[2 * ai + h]) as f32, *s);
                                }
                            } else {
                                *s = ab[0].0.mul_add((i[0] + i[1]) as f32, *s);
                                *s = ab[0].1.mul_add(a.sf[ai], *s);
                            }
                        } else {
                            let acc = &mut acc[r];
                            *acc = (ab[0].0 * (i[0] + i[1]) as f32).mul_add(a.d[ai], *acc);
                            *acc = ab[0].1.mul_add(a.ds[ai], *acc);
                        }
                    }
                }
                if sbg > 1 {
                    let d = a.d[a.at(t, sbg * sbi)];
                    for (acc, s) in acc.iter_mut().zip(sum) {
                        *acc = s.mul_add(d, *acc);
                    }
                }
            }
            for (r, v) in acc.iter().enumerate().take(nr) {
                *o.ptr.add(t * o.stride + rgi * ROWS + r) = *v;
            }
        }
    }
}
