//! The bounds-checked reader every wire format decodes with (the meta and
//! link protocols in `meta/proto.rs`, the datagram tier in
//! `transport/dgram/wire.rs`): little-endian fields front to back, every
//! read checked, so no input can make a decoder panic. Each format adds
//! its own field types (`u24`, endpoints, opcodes) on top.

use crate::error::{Errno, Result};

pub const EBADMSG: Errno = Errno(libc::EBADMSG);
pub const EPROTO: Errno = Errno(libc::EPROTO);

pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Reader<'a> {
        Reader { buf, pos: 0 }
    }

    /// The prefix every format starts with: `magic` (u16; else EBADMSG),
    /// `version` (u8; else EPROTO, judged before anything else so that a
    /// future version is told apart), then the kind byte, returned.
    pub fn prefix(&mut self, magic: u16, version: u8) -> Result<u8> {
        if self.u16()? != magic {
            return Err(EBADMSG);
        }
        if self.u8()? != version {
            return Err(EPROTO);
        }
        self.u8()
    }

    pub fn bytes<const N: usize>(&mut self) -> Result<[u8; N]> {
        let b = self.buf.get(self.pos..).and_then(<[u8]>::first_chunk::<N>).ok_or(EBADMSG)?;
        self.pos += N;
        Ok(*b)
    }

    pub fn u8(&mut self) -> Result<u8> {
        self.bytes().map(u8::from_le_bytes)
    }

    pub fn u16(&mut self) -> Result<u16> {
        self.bytes().map(u16::from_le_bytes)
    }

    pub fn u32(&mut self) -> Result<u32> {
        self.bytes().map(u32::from_le_bytes)
    }

    pub fn u64(&mut self) -> Result<u64> {
        self.bytes().map(u64::from_le_bytes)
    }

    /// The next `n` bytes as they are.
    pub fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).ok_or(EBADMSG)?;
        let b = self.buf.get(self.pos..end).ok_or(EBADMSG)?;
        self.pos = end;
        Ok(b)
    }

    /// `n` reserved bytes, which must be zero.
    pub fn reserved(&mut self, n: usize) -> Result<()> {
        all_zero(self.take(n)?)
    }

    /// The rest is reserved (zero), as in fixed-length messages.
    pub fn finish_zeroed(self) -> Result<()> {
        all_zero(&self.buf[self.pos..])
    }

    /// Nothing follows, as in messages whose length their fields give.
    pub fn finish_exact(self) -> Result<()> {
        if self.pos == self.buf.len() {
            Ok(())
        } else {
            Err(EBADMSG)
        }
    }
}

fn all_zero(b: &[u8]) -> Result<()> {
    if b.iter().all(|&x| x == 0) {
        Ok(())
    } else {
        Err(EBADMSG)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_are_bounded_and_little_endian() {
        let buf = [1, 2, 3, 4, 5, 6, 7, 0, 0];
        let mut r = Reader::new(&buf);
        assert_eq!(r.u16(), Ok(0x0201));
        assert_eq!(r.u32(), Ok(0x0605_0403));
        assert_eq!(r.take(1), Ok(&[7u8][..]));
        assert_eq!(r.u64(), Err(EBADMSG), "past the end");
        assert_eq!(r.take(usize::MAX), Err(EBADMSG), "no overflow");
        r.reserved(2).unwrap();
        r.finish_exact().unwrap();
        let mut r = Reader::new(&buf[6..]);
        assert_eq!(r.reserved(1), Err(EBADMSG), "reserved bytes are zero");
        let mut r = Reader::new(&buf);
        r.u8().unwrap();
        assert_eq!(Reader::new(&buf).finish_exact(), Err(EBADMSG));
        assert_eq!(r.finish_zeroed(), Err(EBADMSG));
    }
}
