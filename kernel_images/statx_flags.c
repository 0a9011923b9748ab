/* Preloaded in every process of the kernel images (/etc/ld.so.preload): `stat` and `ls -l` work
 * under gVisor. gVisor 20221219 (Debian's runsc) refuses the AT_NO_AUTOMOUNT flag of statx and
 * fstatat with EINVAL, and coreutils passes it on every call; the flag only matters on an
 * automount point, which no sandbox has, so it is dropped here before the system call. Nothing
 * else changes: the same system call, the same arguments, the same errno. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

int statx(int dirfd, const char *restrict path, int flags, unsigned int mask,
          struct statx *restrict buf) {
    return (int)syscall(SYS_statx, dirfd, path, flags & ~AT_NO_AUTOMOUNT, mask, buf);
}

int fstatat(int dirfd, const char *restrict path, struct stat *restrict buf, int flags) {
    return (int)syscall(SYS_newfstatat, dirfd, path, buf, flags & ~AT_NO_AUTOMOUNT);
}

int fstatat64(int dirfd, const char *restrict path, struct stat64 *restrict buf, int flags) {
    return (int)syscall(SYS_newfstatat, dirfd, path, buf, flags & ~AT_NO_AUTOMOUNT);
}
