//! The library's own cost per data-path dispatch, isolated from any NIC:
//! the "real" provider is a test double whose post_send/poll_cq return at
//! once. Each pair measures the same inline-verbs call (`qp->context->ops.
//! post_send(...)`) on a raw object and on the krcore wrapper around it.

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use krcore::abi::ops::install_context_ops;
use krcore::obj::{Context, Cq, Qp};
use krcore::sys::*;
use libc::c_int;
use std::ptr::null_mut;

unsafe extern "C" fn fake_post_send(_: *mut ibv_qp, _: *mut ibv_send_wr, _: *mut *mut ibv_send_wr) -> c_int {
    0
}
unsafe extern "C" fn fake_post_recv(_: *mut ibv_qp, _: *mut ibv_recv_wr, _: *mut *mut ibv_recv_wr) -> c_int {
    0
}
unsafe extern "C" fn fake_poll_cq(_: *mut ibv_cq, _: c_int, _: *mut ibv_wc) -> c_int {
    0
}

fn zeroed<T>() -> Box<T> {
    // SAFETY: plain C structs.
    Box::new(unsafe { std::mem::zeroed() })
}

/// What `ibv_post_send()` in verbs.h does.
#[inline(always)]
unsafe fn ibv_post_send(qp: *mut ibv_qp, wr: *mut ibv_send_wr) -> c_int {
    let mut bad = null_mut();
    unsafe { ((*(*qp).context).ops.post_send.unwrap())(qp, wr, &mut bad) }
}

/// What `ibv_poll_cq()` in verbs.h does.
#[inline(always)]
unsafe fn ibv_poll_cq(cq: *mut ibv_cq, wc: *mut ibv_wc) -> c_int {
    unsafe { ((*(*cq).context).ops.poll_cq.unwrap())(cq, 1, wc) }
}

fn dispatch(c: &mut Criterion) {
    let mut real_ctx: Box<ibv_context> = zeroed();
    real_ctx.ops.post_send = Some(fake_post_send);
    real_ctx.ops.post_recv = Some(fake_post_recv);
    real_ctx.ops.poll_cq = Some(fake_poll_cq);
    let mut real_qp: Box<ibv_qp> = zeroed();
    real_qp.context = &mut *real_ctx;
    real_qp.qp_type = ibv_qp_type::IBV_QPT_RC;
    let mut real_cq: Box<ibv_cq> = zeroed();
    real_cq.context = &mut *real_ctx;

    // SAFETY: the fakes live until the end of this function.
    let mut ctx = unsafe { Context::new(&mut *real_ctx) };
    install_context_ops(&mut ctx);
    let qp = unsafe { Qp::adopt(&mut ctx, &mut *real_qp) };
    let cq = unsafe { Cq::adopt(&mut ctx, &mut *real_cq) };

    let mut sge = ibv_sge { addr: 0x1000, length: 8, lkey: 1 };
    let mut wr: Box<ibv_send_wr> = zeroed();
    wr.sg_list = &mut sge;
    wr.num_sge = 1;
    wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE;
    let mut wc: Box<ibv_wc> = zeroed();
    let (rq, rc): (*mut ibv_qp, *mut ibv_cq) = (&mut *real_qp, &mut *real_cq);

    let mut g = c.benchmark_group("post_send");
    g.bench_function("raw", |b| b.iter(|| unsafe { ibv_post_send(black_box(rq), black_box(&mut *wr)) }));
    g.bench_function("krcore", |b| b.iter(|| unsafe { ibv_post_send(black_box(qp), black_box(&mut *wr)) }));
    g.finish();
    let mut g = c.benchmark_group("poll_cq");
    g.bench_function("raw", |b| b.iter(|| unsafe { ibv_poll_cq(black_box(rc), black_box(&mut *wc)) }));
    g.bench_function("krcore", |b| b.iter(|| unsafe { ibv_poll_cq(black_box(cq), black_box(&mut *wc)) }));
    g.finish();
}

criterion_group!(benches, dispatch);
criterion_main!(benches);
