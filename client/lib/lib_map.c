/*
 * lib_map.c - the process-wide table of mapped slabs.
 *
 * DESIGN: every attach in this process, through any handle and on any
 * thread, looks its slab up here by set id and slab identity (fd: the memfd's
 * st_dev/st_ino; cuda_ipc: the IPC handle's bytes; cuda_vmm: the daemon's
 * allocation id), so one set is mapped once and every weightd_set of it sees
 * the same base address. Entries are reference-counted; the last
 * weightd_release unmaps. One mutex guards the list and is held across mmap,
 * cuIpcOpenMemHandle and the VMM import, so two threads attaching the same set
 * never map it twice; the last reference is unlinked under the lock and
 * unmapped after it. Binary tensor tables are shared the same way (by the
 * memfd's identity), under a lock of their own, and validated once.
 *
 * fork(): another thread may hold either lock across a long import when some
 * thread forks, and a child may release the sets it inherited. So fork waits
 * for both locks (pthread_atfork: map_lock, then table_lock, the only order in
 * which they are ever held together) and parent and child each unlock them;
 * the child's table is then in a consistent state. The handlers are installed
 * before the first lock is taken.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "lib_internal.h"

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010 /* Linux 5.1 */
#endif

static pthread_mutex_t map_lock = PTHREAD_MUTEX_INITIALIZER;
static struct lib_mapping *maps;
static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;
static struct lib_table *tables;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void fork_prepare(void) {
  pthread_mutex_lock(&map_lock);
  pthread_mutex_lock(&table_lock);
}

static void fork_done(void) {
  pthread_mutex_unlock(&table_lock);
  pthread_mutex_unlock(&map_lock);
}

static void atfork_install(void) { pthread_atfork(fork_prepare, fork_done, fork_done); }

static void lock_maps(void) {
  pthread_once(&atfork_once, atfork_install);
  pthread_mutex_lock(&map_lock);
}

static void lock_tables(void) {
  pthread_once(&atfork_once, atfork_install);
  pthread_mutex_lock(&table_lock);
}

/*
 * The mapping of set_id with that identity (ident: the IPC handle or the
 * allocation id), or NULL; called with map_lock held.
 */
static struct lib_mapping *find(const char *set_id, enum wd_handle_kind handle, dev_t dev, ino_t ino,
                                const unsigned char *ident) {
  for (struct lib_mapping *m = maps; m != NULL; m = m->next) {
    if (m->handle != handle || strcmp(m->set_id, set_id) != 0) continue;
    if (handle == WD_HANDLE_FD && m->dev == dev && m->ino == ino) return m;
    if (handle == WD_HANDLE_CUDA_IPC && memcmp(m->ipc, ident, sizeof m->ipc) == 0) return m;
    if (handle == WD_HANDLE_CUDA_VMM && memcmp(m->alloc_id, ident, sizeof m->alloc_id) == 0) return m;
  }
  return NULL;
}

static struct lib_mapping *entry_new(const char *set_id, enum wd_handle_kind handle, uint64_t bytes) {
  struct lib_mapping *m = calloc(1, sizeof *m);
  if (m == NULL) return NULL;
  m->set_id = strdup(set_id);
  if (m->set_id == NULL) {
    free(m);
    return NULL;
  }
  m->handle = handle;
  m->fd = -1;
  m->bytes = bytes;
  m->refs = 1;
  return m;
}

int lib_map_host(const char *set_id, int fd, uint64_t bytes, struct lib_mapping **out, struct wd_error *err) {
  struct stat st;
  int rc = 0;
  lock_maps();
  if (fstat(fd, &st) != 0) {
    rc = err_set(err, WEIGHTD_E_IO, "fstat of the received descriptor: %s", strerror(errno));
    goto done;
  }
  struct lib_mapping *m = find(set_id, WD_HANDLE_FD, st.st_dev, st.st_ino, NULL);
  if (m != NULL) {
    m->refs++;
    *out = m;
    goto done;
  }
  /*
   * Sealed against shrinking (no SIGBUS under our readers) and writing (shared
   * weights stay intact): F_SEAL_WRITE once filled, F_SEAL_FUTURE_WRITE while
   * it fills (an early attach: only the daemon's own mapping writes).
   */
  int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || !(seals & F_SEAL_SHRINK) || !(seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE))) {
    rc = err_set(err, WEIGHTD_E_PROTOCOL, "the set's memory descriptor is not sealed against writing and shrinking");
    goto done;
  }
  if (!S_ISREG(st.st_mode) || st.st_size < 0 || (uint64_t)st.st_size < bytes) {
    rc = err_set(err, WEIGHTD_E_PROTOCOL, "the set's memory holds %lld bytes, the set needs %llu",
                 (long long)st.st_size, (unsigned long long)bytes);
    goto done;
  }
  m = entry_new(set_id, WD_HANDLE_FD, bytes);
  if (m == NULL) {
    rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    goto done;
  }
  if (bytes > 0) {
    m->base = mmap(NULL, bytes, PROT_READ, MAP_SHARED, fd, 0);
    if (m->base == MAP_FAILED) {
      rc = err_set(err, errno == ENOMEM ? WEIGHTD_E_NOMEM : WEIGHTD_E_IO, "mmap of %llu bytes: %s",
                   (unsigned long long)bytes, strerror(errno));
      free(m->set_id);
      free(m);
      goto done;
    }
  }
  m->dev = st.st_dev;
  m->ino = st.st_ino;
  m->read_only = 1;
  m->next = maps;
  maps = m;
  *out = m;
done:
  pthread_mutex_unlock(&map_lock);
  close(fd);
  return rc;
}

int lib_map_cuda(const char *set_id, const char *device_uuid, const unsigned char handle[WD_IPC_HANDLE_BYTES],
                 uint64_t bytes, struct lib_mapping **out, struct wd_error *err) {
  int rc = 0;
  lock_maps();
  struct lib_mapping *m = find(set_id, WD_HANDLE_CUDA_IPC, 0, 0, handle);
  if (m != NULL) {
    m->refs++;
    *out = m;
    goto done;
  }
  m = entry_new(set_id, WD_HANDLE_CUDA_IPC, bytes);
  if (m == NULL) {
    rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    goto done;
  }
  memcpy(m->ipc, handle, sizeof m->ipc);
  uint64_t dptr = 0;
  if ((rc = cuimp_device_find(device_uuid, &m->cudev, err)) != 0 ||
      (rc = cuimp_ipc_open(&m->cudev, handle, &dptr, err)) != 0) {
    cuimp_device_put(&m->cudev);
    free(m->set_id);
    free(m);
    goto done;
  }
  m->base = (void *)(uintptr_t)dptr;
  m->next = maps;
  maps = m;
  *out = m;
done:
  pthread_mutex_unlock(&map_lock);
  return rc;
}

int lib_map_vmm(const char *set_id, const char *device_uuid, int fd, uint64_t bytes,
                const unsigned char alloc_id[WD_ALLOC_ID_BYTES], struct lib_mapping **out, struct wd_error *err) {
  int rc = 0;
  lock_maps();
  struct lib_mapping *m = find(set_id, WD_HANDLE_CUDA_VMM, 0, 0, alloc_id);
  if (m != NULL) {
    m->refs++;
    *out = m;
    goto done;
  }
  m = entry_new(set_id, WD_HANDLE_CUDA_VMM, bytes);
  if (m == NULL) {
    rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    goto done;
  }
  memcpy(m->alloc_id, alloc_id, sizeof m->alloc_id);
  if ((rc = cuimp_device_find(device_uuid, &m->cudev, err)) != 0 ||
      (rc = cuimp_vmm_map(&m->cudev, fd, bytes, &m->vmm, err)) != 0) {
    cuimp_device_put(&m->cudev);
    free(m->set_id);
    free(m);
    goto done;
  }
  m->fd = fd;
  fd = -1; /* kept with the mapping */
  m->base = (void *)(uintptr_t)m->vmm.va;
  m->read_only = m->vmm.read_only;
  m->next = maps;
  maps = m;
  *out = m;
done:
  pthread_mutex_unlock(&map_lock);
  if (fd >= 0) close(fd);
  return rc;
}

int lib_map_put(struct lib_mapping *m, int in_child, struct wd_error *err) {
  if (m == NULL) return 0;
  int rc = 0;
  lock_maps();
  if (--m->refs > 0) {
    pthread_mutex_unlock(&map_lock);
    return 0;
  }
  for (struct lib_mapping **p = &maps; *p != NULL; p = &(*p)->next)
    if (*p == m) {
      *p = m->next;
      break;
    }
  pthread_mutex_unlock(&map_lock);
  if (m->handle == WD_HANDLE_FD && m->base != NULL) {
    if (munmap(m->base, m->bytes) != 0)
      rc = err_set(err, WEIGHTD_E_INTERNAL, "munmap: %s", strerror(errno));
  } else if (m->handle == WD_HANDLE_CUDA_IPC && !in_child) {
    /* A forked child inherits no CUDA mappings: only the parent closes them. */
    rc = cuimp_ipc_close(&m->cudev, (uint64_t)(uintptr_t)m->base, err);
    cuimp_device_put(&m->cudev);
  } else if (m->handle == WD_HANDLE_CUDA_VMM && !in_child) {
    rc = cuimp_vmm_unmap(&m->cudev, &m->vmm, err);
    cuimp_device_put(&m->cudev);
  }
  if (m->fd >= 0) close(m->fd); /* a child closes its inherited copy */
  free(m->set_id);
  free(m);
  return rc;
}

/* ---- binary tensor tables ------------------------------------------------------------ */

int lib_map_table(int fd, uint64_t bytes, struct lib_table **out, struct wd_error *err) {
  struct stat st;
  int rc = 0;
  lock_tables();
  if (fstat(fd, &st) != 0) {
    rc = err_set(err, WEIGHTD_E_IO, "fstat of the tensor table's descriptor: %s", strerror(errno));
    goto done;
  }
  for (struct lib_table *t = tables; t != NULL; t = t->next)
    if (t->dev == st.st_dev && t->ino == st.st_ino) {
      t->refs++;
      *out = t;
      goto done;
    }
  int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & (F_SEAL_SHRINK | F_SEAL_WRITE)) != (F_SEAL_SHRINK | F_SEAL_WRITE) || !S_ISREG(st.st_mode) ||
      st.st_size < 0 || (uint64_t)st.st_size != bytes || bytes == 0 || bytes > SIZE_MAX) {
    rc = err_set(err, WEIGHTD_E_PROTOCOL, "the tensor table's descriptor is not a sealed memfd of %llu bytes",
                 (unsigned long long)bytes);
    goto done;
  }
  struct lib_table *t = calloc(1, sizeof *t);
  if (t == NULL) {
    rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    goto done;
  }
  t->len = (size_t)bytes;
  t->base = mmap(NULL, t->len, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (t->base == MAP_FAILED) {
    rc = err_set(err, errno == ENOMEM ? WEIGHTD_E_NOMEM : WEIGHTD_E_IO, "mmap of the tensor table: %s", strerror(errno));
    free(t);
    goto done;
  }
  if ((rc = ttab_open(t->base, t->len, &t->t, err)) != 0) {
    munmap(t->base, t->len);
    free(t);
    goto done;
  }
  t->dev = st.st_dev;
  t->ino = st.st_ino;
  t->refs = 1;
  t->next = tables;
  tables = t;
  *out = t;
done:
  pthread_mutex_unlock(&table_lock);
  close(fd);
  return rc;
}

void lib_table_put(struct lib_table *t) {
  if (t == NULL) return;
  lock_tables();
  if (--t->refs > 0) {
    pthread_mutex_unlock(&table_lock);
    return;
  }
  for (struct lib_table **p = &tables; *p != NULL; p = &(*p)->next)
    if (*p == t) {
      *p = t->next;
      break;
    }
  pthread_mutex_unlock(&table_lock);
  munmap(t->base, t->len);
  free(t);
}
