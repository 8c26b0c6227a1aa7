# krcore: build and install like an RDMA library.
#
#   make                                     cargo build --release
#   sudo make install                        into /usr/local
#   make install PREFIX=/usr DESTDIR=/tmp/stage    staged (packaging)
#   sudo make uninstall                      same variables as install
#
# What goes where (PREFIX=/usr/local, multiarch x86_64-linux-gnu):
#   $(LIBDIR)        libkrcore.so           /usr/local/lib/x86_64-linux-gnu
#   $(INCLUDEDIR)    krcore.h               /usr/local/include
#   $(PKGCONFIGDIR)  krcore.pc              $(LIBDIR)/pkgconfig
#   $(BINDIR)        the crate's binaries   /usr/local/bin (src/bin/*: krcore-meta, krcore-node; not krcore-hostile, a test tool)
# Then: cc app.c $(pkg-config --cflags --libs krcore). After a system-wide
# install run ldconfig (as for any new library in a system directory).
#
# ABI: krcore is 0.x and its ABI is unversioned. libkrcore.so has no soname
# and is installed under that one name (no libkrcore.so.N links): programs
# record NEEDED libkrcore.so, and a new install replaces the old library.
# The ibv_* part of the ABI is libibverbs' own; the krcore_* C API
# (include/krcore.h) may still change between 0.x versions.
#
# install only builds if the library is missing, so `sudo make install`
# after `make` installs what was built instead of running cargo as root.
# Generated files (krcore.pc) go under target/, like the rest of the build.

PREFIX       ?= /usr/local
DESTDIR      ?=
CC           ?= cc
CARGO        ?= cargo
INSTALL      ?= install
# Debian/Ubuntu multiarch triplet (x86_64-linux-gnu); empty elsewhere -> lib.
MULTIARCH    := $(shell $(CC) -print-multiarch 2>/dev/null)
LIBDIR       ?= $(PREFIX)/lib$(if $(MULTIARCH),/$(MULTIARCH))
INCLUDEDIR   ?= $(PREFIX)/include
BINDIR       ?= $(PREFIX)/bin
PKGCONFIGDIR ?= $(LIBDIR)/pkgconfig

ROOT    := $(patsubst %/,%,$(dir $(abspath $(lastword $(MAKEFILE_LIST)))))
OUT     := $(ROOT)/target/release
LIB     := $(OUT)/libkrcore.so
HEADER  := $(ROOT)/include/krcore.h
PC      := $(ROOT)/target/krcore.pc
# Cargo.toml's first `version = "..."` line is the [package] version.
VERSION := $(shell sed -n 's/^version *= *"\(.*\)"/\1/p' $(ROOT)/Cargo.toml | head -n 1)
# Binary targets: src/bin/<name>.rs and src/bin/<name>/main.rs -> target/release/<name>,
# but krcore-hostile, the tests' hostile peer (not for installing).
BINS    := $(filter-out krcore-hostile, \
             $(sort $(basename $(notdir $(wildcard $(ROOT)/src/bin/*.rs))) \
                    $(notdir $(patsubst %/,%,$(dir $(wildcard $(ROOT)/src/bin/*/main.rs))))))
# In the .pc file, paths under the prefix are written as ${prefix}/...
pcpath   = $(patsubst $(PREFIX)/%,$${prefix}/%,$(1))

.PHONY: all install uninstall FORCE
all:
	cd $(ROOT) && $(CARGO) build --release

# Built only when missing (see above).
$(LIB) $(addprefix $(OUT)/,$(BINS)):
	cd $(ROOT) && $(CARGO) build --release

# Regenerated on every run: PREFIX and LIBDIR may differ from the last one
# (and replaced, not rewritten, in case `sudo make install` left it root's).
$(PC): $(ROOT)/krcore.pc.in FORCE
	@mkdir -p $(@D)
	sed -e 's|@PREFIX@|$(PREFIX)|' \
	    -e 's|@LIBDIR@|$(call pcpath,$(LIBDIR))|' \
	    -e 's|@INCLUDEDIR@|$(call pcpath,$(INCLUDEDIR))|' \
	    -e 's|@VERSION@|$(VERSION)|' $< > $@.tmp && mv -f $@.tmp $@

install: $(LIB) $(addprefix $(OUT)/,$(BINS)) $(PC)
	$(INSTALL) -d $(DESTDIR)$(LIBDIR) $(DESTDIR)$(INCLUDEDIR) $(DESTDIR)$(PKGCONFIGDIR)
	$(INSTALL) -m 0755 $(LIB) $(DESTDIR)$(LIBDIR)/libkrcore.so
	$(INSTALL) -m 0644 $(HEADER) $(DESTDIR)$(INCLUDEDIR)/krcore.h
	$(INSTALL) -m 0644 $(PC) $(DESTDIR)$(PKGCONFIGDIR)/krcore.pc
ifneq ($(BINS),)
	$(INSTALL) -d $(DESTDIR)$(BINDIR)
	$(INSTALL) -m 0755 $(addprefix $(OUT)/,$(BINS)) $(DESTDIR)$(BINDIR)/
endif

# Removes the files only; directories may be shared with other packages.
uninstall:
	rm -f $(DESTDIR)$(LIBDIR)/libkrcore.so $(DESTDIR)$(INCLUDEDIR)/krcore.h \
	      $(DESTDIR)$(PKGCONFIGDIR)/krcore.pc $(addprefix $(DESTDIR)$(BINDIR)/,$(BINS))

FORCE:
