/*
 * node-agent single-file launcher.
 *
 * The image ships the agent as ONE executable: this small program with the PyInstaller onedir
 * bundle appended as a payload and a fixed 64-byte trailer at the very end of the file:
 *
 *   magic "NAGENTX1" | u32 format (1) | u32 compression | u64 payload offset |
 *   u64 payload length | sha256 of the payload as stored (32 bytes)      (little-endian)
 *
 * Compression 1 (the only one): the payload is one zstd frame that records its decompressed
 * size and carries zstd's checksum of the content. Decompressed, the
 * payload is: entries of a 16-byte header (u8 type 'd'/'f'/'l', u8 0, u16 mode, u16 path
 * length, u16 0, u64 size), the relative path, then `size` bytes (file content or link target);
 * a header of type 0 ends it. Directories come before what they contain.
 *
 * On start the bundle is used from <root>/<sha256>/ (root: $NODE_AGENT_UNPACK_DIR, else
 * /var/cache/node-agent for root, else $XDG_CACHE_HOME/node-agent or ~/.cache/node-agent):
 *   - warm: the copy is usable -> take a shared flock on <sha256>/.lock (the fd stays open
 *     through exec, so the running agent keeps holding it) and exec the bundle's bootloader with
 *     the same argv (argv[0] unchanged). No hashing, no writes.
 *   - cold: under an exclusive flock on <root>/.lock, check the payload (zstd's checksum of the
 *     content, while decompressing) and unpack it into <root>/.tmp-*, write .boot (this boot's
 *     id), rename to <root>/<sha256>
 *     (complete or absent), then collect garbage: stale .tmp-* (only the lock holder unpacks, so
 *     any is left over from a killed start) and old copies, keeping the current one and one
 *     other. A copy whose .lock cannot be locked exclusively is in use and is never removed.
 *
 * A copy is usable when it has .complete (its files are on disk: written after a syncfs), or
 * when its .boot names the running boot (its files are in the page cache, which only a crash or
 * a reboot loses, and either one changes the boot id). The sync is not waited for: a process of
 * its own (idle I/O priority, detached from the agent's stdio) syncs the file system and then
 * writes .complete, while the agent starts. So a first start costs a decompression and writes
 * to the page cache, not a flush of the whole file system; a copy whose sync never finished is
 * unpacked again after the next boot. Without a readable boot id the sync is done before exec.
 * The unpack root must be a directory owned by the effective user and not group/world-writable.
 *
 * Exported to the agent: NODE_AGENT_EXECUTABLE (this file's path) and NODE_AGENT_BUNDLE (the
 * unpacked directory). Errors: one line on stderr, exit 2.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zstd.h>

#define MAGIC "NAGENTX1"
#define FORMAT 1
#define ZSTD 1
#define MAX_PAYLOAD (4ULL << 30) /* decompressed; far above any real bundle */
#define BOOT_ID "/proc/sys/kernel/random/boot_id"
#define BOOT_ID_LEN 36
#define TRAILER_SIZE 64
#define ENTRY_HEADER 16
#define BOOTLOADER "node-agent"
#define EXIT_LAUNCH 2

static const char *prog = "node-agent";

static void die(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));
static void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s: ", prog);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(EXIT_LAUNCH);
}

/* ---- helpers ------------------------------------------------------------------------------ */

static uint16_t le16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static uint32_t le32(const uint8_t *p) { return (uint32_t)le16(p) | (uint32_t)le16(p + 2) << 16; }
static uint64_t le64(const uint8_t *p) { return (uint64_t)le32(p) | (uint64_t)le32(p + 4) << 32; }

static char root_path[PATH_MAX];

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st, (void)ftw;
    if ((flag == FTW_DP ? rmdir(path) : unlink(path)) != 0 && errno != ENOENT)
        return -1;
    return 0;
}

/* Remove <root>/<name> and everything below it (never following symlinks or mounts). */
static int rm_tree(const char *name) {
    char path[PATH_MAX];
    if (snprintf(path, sizeof path, "%s/%s", root_path, name) >= (int)sizeof path)
        return -1;
    return nftw(path, rm_entry, 16, FTW_DEPTH | FTW_PHYS | FTW_MOUNT);
}

static void mkdir_parents(const char *path, mode_t mode) {
    char buf[PATH_MAX];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf)
        die("unpack directory path too long");
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/')
            continue;
        *p = '\0';
        if (mkdir(buf, 0755) != 0 && errno != EEXIST)
            die("cannot create %s: %s", buf, strerror(errno));
        *p = '/';
    }
    if (mkdir(buf, mode) != 0 && errno != EEXIST)
        die("cannot create %s: %s", buf, strerror(errno));
}

/* The unpack root, created if missing; refused unless owned by us and not writable by others. */
static int open_root(void) {
    const char *env = getenv("NODE_AGENT_UNPACK_DIR");
    int n;
    mode_t mode = 0700;
    if (env && *env) {
        if (env[0] != '/')
            die("NODE_AGENT_UNPACK_DIR must be an absolute path: %s", env);
        n = snprintf(root_path, sizeof root_path, "%s", env);
    } else if (geteuid() == 0) {
        mode = 0755;
        n = snprintf(root_path, sizeof root_path, "/var/cache/node-agent");
    } else if (getenv("XDG_CACHE_HOME") && getenv("XDG_CACHE_HOME")[0] == '/') {
        n = snprintf(root_path, sizeof root_path, "%s/node-agent", getenv("XDG_CACHE_HOME"));
    } else if (getenv("HOME") && getenv("HOME")[0] == '/') {
        n = snprintf(root_path, sizeof root_path, "%s/.cache/node-agent", getenv("HOME"));
    } else {
        die("no place to unpack: set NODE_AGENT_UNPACK_DIR or HOME");
    }
    if (n < 0 || n >= (int)sizeof root_path - 80)
        die("unpack directory path too long");
    while (n > 1 && root_path[n - 1] == '/')
        root_path[--n] = '\0';
    mkdir_parents(root_path, mode);
    int fd = open(root_path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
        die("cannot open unpack directory %s: %s", root_path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0)
        die("cannot stat %s: %s", root_path, strerror(errno));
    if (st.st_uid != geteuid())
        die("unpack directory %s is owned by uid %u, not by uid %u: refusing to run from it",
            root_path, (unsigned)st.st_uid, (unsigned)geteuid());
    if (st.st_mode & 022)
        die("unpack directory %s is group- or world-writable (mode %04o): refusing to run from it",
            root_path, (unsigned)(st.st_mode & 07777));
    return fd;
}

/* This boot's id (36 characters), or "" when it cannot be read. */
static const char *boot_id(void) {
    static char id[BOOT_ID_LEN + 1];
    static int read_once;
    if (!read_once) {
        read_once = 1;
        int fd = open(BOOT_ID, O_RDONLY | O_CLOEXEC);
        if (fd >= 0) {
            if (read(fd, id, BOOT_ID_LEN) != BOOT_ID_LEN)
                id[0] = '\0';
            close(fd);
        }
    }
    return id;
}

/* Does <key>/.boot name this boot? */
static int unpacked_this_boot(int rootfd, const char *key) {
    const char *now = boot_id();
    char path[128], seen[BOOT_ID_LEN + 1] = "";
    if (!now[0])
        return 0;
    snprintf(path, sizeof path, "%s/.boot", key);
    int fd = openat(rootfd, path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, seen, BOOT_ID_LEN);
    close(fd);
    return n == BOOT_ID_LEN && memcmp(seen, now, BOOT_ID_LEN) == 0;
}

/* A usable copy of <key>, with a shared lock held on its .lock (fd left open through exec);
 * -1 if there is none (or the garbage collector holds it right now). *synced: whether its
 * files are known to be on disk (.complete) rather than only unpacked during this boot. */
static int use_copy(int rootfd, const char *key, int *synced) {
    char lock[128], done[128];
    snprintf(lock, sizeof lock, "%s/.lock", key);
    snprintf(done, sizeof done, "%s/.complete", key);
    int fd = openat(rootfd, lock, O_RDONLY | O_NOFOLLOW); /* no O_CLOEXEC: held by the agent */
    if (fd < 0)
        return -1;
    struct stat held, now, marker;
    if (flock(fd, LOCK_SH | LOCK_NB) != 0 || fstat(fd, &held) != 0 ||
        fstatat(rootfd, lock, &now, AT_SYMLINK_NOFOLLOW) != 0 || held.st_ino != now.st_ino ||
        held.st_dev != now.st_dev) {
        close(fd);
        return -1;
    }
    *synced = fstatat(rootfd, done, &marker, AT_SYMLINK_NOFOLLOW) == 0;
    if (!*synced && !unpacked_this_boot(rootfd, key)) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Write <dirfd>/.complete (the key) through a temporary name and fsync it; 0 on success. */
static int mark_complete(int dfd, const char *key) {
    char tmp[64];
    snprintf(tmp, sizeof tmp, ".complete.tmp-%ld", (long)getpid());
    int fd = openat(dfd, tmp, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0)
        return -1;
    char line[66];
    memcpy(line, key, 64);
    line[64] = '\n';
    int ok = write(fd, line, 65) == 65 && fsync(fd) == 0;
    ok = close(fd) == 0 && ok;
    if (!ok || renameat(dfd, tmp, dfd, ".complete") != 0) {
        unlinkat(dfd, tmp, 0);
        return -1;
    }
    return fsync(dfd);
}

/* Make <root>/<key> durable in a process of its own, not waited for: syncfs, then .complete.
 * Double fork, so the agent (exec'd in this process) never sees it as a child; its stdio goes
 * to /dev/null, so whoever reads the agent's output is not held up by it. Best effort: if it
 * dies, the copy stays usable for this boot and is unpacked again after the next one. */
static void sync_later(int rootfd, const char *key) {
    pid_t child = fork();
    if (child < 0)
        return;
    if (child > 0) {
        while (waitpid(child, NULL, 0) < 0 && errno == EINTR)
            ;
        return;
    }
    if (fork() != 0)
        _exit(0);
    int null = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (null >= 0) {
        dup2(null, 0), dup2(null, 1), dup2(null, 2);
        close(null);
    }
    int dfd = openat(rootfd, key, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dfd < 0)
        _exit(1);
    /* Nothing else stays open here: not the copy's lock (it would look in use after the agent
     * stopped), nor any pipe someone waits on for the agent's end. */
    DIR *fds = opendir("/proc/self/fd");
    if (fds) {
        int own = dirfd(fds);
        struct dirent *e;
        while ((e = readdir(fds)) != NULL) {
            int n = atoi(e->d_name);
            if (e->d_name[0] != '.' && n > 2 && n != own && n != dfd && n != rootfd)
                close(n);
        }
        closedir(fds);
    }
    /* IOPRIO_WHO_PROCESS, this process, class idle: the agent's own writes go first. */
    syscall(SYS_ioprio_set, 1, 0, 3 << 13);
    if (syncfs(dfd) != 0 || mark_complete(dfd, key) != 0 || fsync(rootfd) != 0)
        _exit(1);
    _exit(0);
}

static int valid_path(const char *p, size_t len) {
    if (len == 0 || p[0] == '/' || memchr(p, '\0', len))
        return 0;
    const char *c = p, *end = p + len;
    while (c < end) {
        const char *slash = memchr(c, '/', (size_t)(end - c));
        size_t n = slash ? (size_t)(slash - c) : (size_t)(end - c);
        if (n == 0 || (n == 1 && c[0] == '.') || (n == 2 && c[0] == '.' && c[1] == '.'))
            return 0;
        if (c == p && c[0] == '.' && !slash) /* .lock and .complete are ours */
            return 0;
        c += n + 1;
    }
    return 1;
}

static void write_all(int fd, const uint8_t *p, uint64_t n, const char *what) {
    while (n > 0) {
        ssize_t w = write(fd, p, n > (1u << 30) ? (1u << 30) : n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            die("cannot write %s: %s", what, strerror(errno));
        p += w, n -= (uint64_t)w;
    }
}

/* The payload's entries, checked, in memory of their own (an anonymous mapping): zstd's
 * checksum of the content, which the frame must carry, finds damage while it decompresses,
 * without hashing the file a second time on the path of a first start. */
static const uint8_t *open_payload(const uint8_t *stored, uint64_t stored_len, uint64_t *len,
                                   const char *exe) {
    /* Frame: magic 28 b5 2f fd, then the descriptor byte; bit 2 is Content_Checksum_flag. */
    static const uint8_t zstd_magic[4] = {0x28, 0xb5, 0x2f, 0xfd};
    unsigned long long size = ZSTD_getFrameContentSize(stored, stored_len);
    if (stored_len < 5 || memcmp(stored, zstd_magic, 4) != 0 || !(stored[4] & 0x04) ||
        size == ZSTD_CONTENTSIZE_UNKNOWN || size == ZSTD_CONTENTSIZE_ERROR || size == 0 ||
        size > MAX_PAYLOAD)
        die("%s is corrupted: its payload does not match its checksum (no zstd frame with a "
            "size and a checksum)", exe);
    void *out =
        mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (out == MAP_FAILED)
        die("cannot allocate %llu bytes to decompress %s: %s", size, exe, strerror(errno));
    size_t got = ZSTD_decompress(out, (size_t)size, stored, (size_t)stored_len);
    if (ZSTD_isError(got) || got != size)
        die("%s is corrupted: its payload does not match its checksum (zstd: %s)", exe,
            ZSTD_isError(got) ? ZSTD_getErrorName(got) : "short");
    *len = size;
    return out;
}

/* Unpack the payload into <root>/<key>, atomically. Caller holds <root>/.lock. Returns whether
 * the copy is already on disk (no boot id to tie it to: synced here, before anything runs). */
static int unpack(int rootfd, const char *key, const uint8_t *payload, uint64_t len,
                  const char *exe) {
    char tmp[128];
    snprintf(tmp, sizeof tmp, ".tmp-%.16s-%ld", key, (long)getpid());
    if (mkdirat(rootfd, tmp, 0755) != 0)
        die("cannot create %s/%s: %s", root_path, tmp, strerror(errno));
    int dfd = openat(rootfd, tmp, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dfd < 0)
        die("cannot open %s/%s: %s", root_path, tmp, strerror(errno));
    int lfd = openat(dfd, ".lock", O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (lfd < 0)
        die("cannot create %s/%s/.lock: %s", root_path, tmp, strerror(errno));
    close(lfd);

    uint64_t pos = 0;
    char path[PATH_MAX], target[PATH_MAX];
    for (;;) {
        if (len - pos < ENTRY_HEADER)
            die("%s is corrupted: payload ends inside an entry", exe);
        const uint8_t *h = payload + pos;
        uint8_t type = h[0];
        mode_t mode = le16(h + 2) & 07777;
        uint16_t plen = le16(h + 4);
        uint64_t size = le64(h + 8);
        pos += ENTRY_HEADER;
        if (type == 0)
            break;
        if (plen >= sizeof path || len - pos < plen || len - pos - plen < size)
            die("%s is corrupted: bad payload entry at offset %llu", exe,
                (unsigned long long)(pos - ENTRY_HEADER));
        memcpy(path, payload + pos, plen);
        path[plen] = '\0';
        if (!valid_path(path, plen))
            die("%s is corrupted: bad path in payload: %s", exe, path);
        const uint8_t *data = payload + pos + plen;
        pos += plen + size;
        if (type == 'd') {
            if (mkdirat(dfd, path, mode) != 0 && errno != EEXIST)
                die("cannot create %s/%s/%s: %s", root_path, tmp, path, strerror(errno));
            fchmodat(dfd, path, mode, 0);
        } else if (type == 'f') {
            int fd = openat(dfd, path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
            if (fd < 0)
                die("cannot create %s/%s/%s: %s", root_path, tmp, path, strerror(errno));
            write_all(fd, data, size, path);
            if (fchmod(fd, mode) != 0 || close(fd) != 0)
                die("cannot finish %s/%s/%s: %s", root_path, tmp, path, strerror(errno));
        } else if (type == 'l') {
            if (size >= sizeof target)
                die("%s is corrupted: link target too long", exe);
            memcpy(target, data, size);
            target[size] = '\0';
            if (symlinkat(target, dfd, path) != 0)
                die("cannot create %s/%s/%s: %s", root_path, tmp, path, strerror(errno));
        } else {
            die("%s is corrupted: unknown payload entry type %u", exe, type);
        }
    }
    if (pos != len)
        die("%s is corrupted: data after the payload's end", exe);
    const char *boot = boot_id();
    int synced = !boot[0];
    if (synced) {
        if (syncfs(dfd) != 0 || mark_complete(dfd, key) != 0)
            die("cannot sync %s/%s: %s", root_path, tmp, strerror(errno));
    } else {
        int bfd = openat(dfd, ".boot", O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
        if (bfd < 0)
            die("cannot create %s/%s/.boot: %s", root_path, tmp, strerror(errno));
        write_all(bfd, (const uint8_t *)boot, BOOT_ID_LEN, ".boot");
        write_all(bfd, (const uint8_t *)"\n", 1, ".boot");
        close(bfd);
    }
    close(dfd);
    /* A <key> that is not usable is a broken leftover (we hold the lock): replace it. */
    if (renameat(rootfd, tmp, rootfd, key) != 0) {
        char old[128];
        snprintf(old, sizeof old, ".tmp-old-%.16s-%ld", key, (long)getpid());
        if (renameat(rootfd, key, rootfd, old) != 0 || renameat(rootfd, tmp, rootfd, key) != 0)
            die("cannot move %s/%s into place: %s", root_path, tmp, strerror(errno));
        rm_tree(old);
    }
    if (synced && fsync(rootfd) != 0)
        die("cannot sync %s: %s", root_path, strerror(errno));
    return synced;
}

static int is_key(const char *name) {
    if (strlen(name) != 64)
        return 0;
    for (const char *c = name; *c; c++)
        if (!((*c >= '0' && *c <= '9') || (*c >= 'a' && *c <= 'f')))
            return 0;
    return 1;
}

/* Caller holds <root>/.lock: nobody else unpacks or collects right now. */
static void collect(int rootfd, const char *key) {
    struct old {
        char name[65];
        int lockfd; /* exclusively locked, -1 when in use */
        struct timespec mtime;
    } olds[64];
    int n = 0, busy = 0;
    int fd = dup(rootfd);
    DIR *dir = fd >= 0 ? fdopendir(fd) : NULL;
    if (!dir)
        return;
    lseek(fd, 0, SEEK_SET);
    struct dirent *e;
    while ((e = readdir(dir)) != NULL) {
        if (strncmp(e->d_name, ".tmp-", 5) == 0) {
            rm_tree(e->d_name); /* left by a start that was killed while unpacking */
            continue;
        }
        if (!is_key(e->d_name) || strcmp(e->d_name, key) == 0 || n == 64)
            continue;
        struct old *o = &olds[n++];
        snprintf(o->name, sizeof o->name, "%s", e->d_name);
        char lock[128];
        snprintf(lock, sizeof lock, "%s/.lock", o->name);
        o->lockfd = openat(rootfd, lock, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
        if (o->lockfd >= 0 && flock(o->lockfd, LOCK_EX | LOCK_NB) != 0) {
            close(o->lockfd);
            o->lockfd = -1;
            busy++;
            continue;
        }
        if (o->lockfd < 0)
            o->lockfd = -2; /* no lock file: not a copy anyone can be using */
        struct stat st; /* when it was unpacked: .lock is its first file, never written again */
        o->mtime = o->lockfd >= 0 && fstat(o->lockfd, &st) == 0 ? st.st_mtim
                                                                 : (struct timespec){0, 0};
    }
    closedir(dir);
    /* Keep one other copy besides the current one: one in use if any, else the newest. */
    int keep = -1;
    if (busy == 0)
        for (int i = 0; i < n; i++)
            if (keep < 0 || olds[i].mtime.tv_sec > olds[keep].mtime.tv_sec ||
                (olds[i].mtime.tv_sec == olds[keep].mtime.tv_sec &&
                 olds[i].mtime.tv_nsec > olds[keep].mtime.tv_nsec))
                keep = i;
    for (int i = 0; i < n; i++) {
        if (olds[i].lockfd == -1 || i == keep) {
            if (olds[i].lockfd >= 0)
                close(olds[i].lockfd);
            continue;
        }
        char gone[128];
        snprintf(gone, sizeof gone, ".tmp-gc-%.16s-%ld", olds[i].name, (long)getpid());
        /* Renamed first, so a copy is complete or absent under its name, never half removed. */
        if (renameat(rootfd, olds[i].name, rootfd, gone) == 0)
            rm_tree(gone);
        if (olds[i].lockfd >= 0)
            close(olds[i].lockfd);
    }
}

int main(int argc, char **argv) {
    (void)argc;
    if (argv[0] && *argv[0]) {
        const char *slash = strrchr(argv[0], '/');
        prog = slash ? slash + 1 : argv[0];
    }
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n < 0)
        die("cannot read /proc/self/exe: %s", strerror(errno));
    exe[n] = '\0';
    int fd = open("/proc/self/exe", O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0)
        die("cannot open %s: %s", exe, strerror(errno));
    uint8_t t[TRAILER_SIZE];
    if (st.st_size < TRAILER_SIZE ||
        pread(fd, t, TRAILER_SIZE, st.st_size - TRAILER_SIZE) != TRAILER_SIZE ||
        memcmp(t, MAGIC, 8) != 0)
        die("%s has no node-agent payload trailer: the file is truncated or corrupted", exe);
    uint64_t off = le64(t + 16), len = le64(t + 24);
    uint32_t compression = le32(t + 12);
    if (le32(t + 8) != FORMAT)
        die("%s: unknown payload format %u", exe, le32(t + 8));
    if (compression != ZSTD)
        die("%s: unknown payload compression %u", exe, compression);
    if (off == 0 || off > (uint64_t)st.st_size || len != (uint64_t)st.st_size - TRAILER_SIZE - off)
        die("%s is truncated or corrupted: the payload does not fit the file", exe);
    char key[65];
    for (int i = 0; i < 32; i++)
        snprintf(key + 2 * i, 3, "%02x", t[32 + i]);

    int rootfd = open_root();
    int synced = 0;
    int lockfd = use_copy(rootfd, key, &synced);
    if (lockfd < 0) {
        int gfd = openat(rootfd, ".lock", O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
        if (gfd < 0 || flock(gfd, LOCK_EX) != 0)
            die("cannot lock %s/.lock: %s", root_path, strerror(errno));
        lockfd = use_copy(rootfd, key, &synced); /* another start may have unpacked it */
        if (lockfd < 0) {
            void *map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
            if (map == MAP_FAILED)
                die("cannot map %s: %s", exe, strerror(errno));
            uint64_t size;
            const uint8_t *stored = (const uint8_t *)map + off;
            const uint8_t *payload = open_payload(stored, len, &size, exe);
            unpack(rootfd, key, payload, size, exe);
            munmap((void *)payload, (size_t)size);
            munmap(map, (size_t)st.st_size);
            lockfd = use_copy(rootfd, key, &synced);
            if (lockfd < 0)
                die("unpacked %s/%s but cannot use it", root_path, key);
        }
        collect(rootfd, key);
        close(gfd);
    }
    if (!synced)
        sync_later(rootfd, key);
    close(fd);
    close(rootfd);

    char bundle[PATH_MAX + 80], boot[PATH_MAX + 96]; /* root_path leaves room anyway */
    snprintf(bundle, sizeof bundle, "%s/%s", root_path, key);
    snprintf(boot, sizeof boot, "%s/%s", bundle, BOOTLOADER);
    if (setenv("NODE_AGENT_EXECUTABLE", exe, 1) != 0 || setenv("NODE_AGENT_BUNDLE", bundle, 1) != 0)
        die("cannot set the environment: %s", strerror(errno));
    execv(boot, argv);
    die("cannot run %s: %s", boot, strerror(errno));
}
