/* How an engine calls the kernels of `linrec emit examples/mamba2.lin --backend c --standalone --out kernels
   --heads 4` (docs/embedding.md): a prompt with snapshots, then one decode step over a pool of slots.
   Build: gcc -O2 -march=native -fopenmp -I kernels examples/embedding/mamba2_engine.c kernels/mamba2.c -lm */
#include <stdio.h>
#include <string.h>
#include "mamba2.h"

enum { T = 8, H = MAMBA2_PARAMS_HEADS, DK = MAMBA2_dim_dk, DV = MAMBA2_dim_dv, P = 4, N = 2 };

static float x[T][H][DV], Bk[T][H][DK], C[T][H][DK], dt[T][H], y[T][H][DV];  /* B = 1 */
static float S[H][DK][DV], ckpt[T / 4][H][DK][DV], last[2][H][DK][DV];
static float S4[H][DK][DV], y4[4][H][DV];
static float pool[P][H][DK][DV], before[P][H][DK][DV], tx[N][H][DV], tB[N][H][DK], tC[N][H][DK], tdt[N][H],
             ty[N][H][DV];

int main(void)
{
    /* the params: linrec's defaults, float64 in mamba2_params.bin, as float for the _f32 kernels */
    double raw[3 * H];
    float A_log[H], A[H], D[H];
    FILE *f = fopen("kernels/mamba2_params.bin", "rb");
    if (!f || fread(raw, sizeof raw[0], 3 * H, f) != 3 * H) return 1;
    fclose(f);
    for (int h = 0; h < H; ++h) {
        A_log[h] = (float)raw[MAMBA2_prm_A_log_OFFSET + h];
        A[h] = (float)raw[MAMBA2_prm_A_OFFSET + h];
        D[h] = (float)raw[MAMBA2_prm_D_OFFSET + h];
    }
    /* a prompt (made up): inputs [B, T, H, *], dt > 0 as the program declares */
    for (int t = 0; t < T; ++t)
        for (int h = 0; h < H; ++h) {
            for (int i = 0; i < DV; ++i) x[t][h][i] = (float)((t * 7 + h * 3 + i) % 11) / 11 - 0.5f;
            for (int i = 0; i < DK; ++i) Bk[t][h][i] = C[t][h][i] = (float)((t + 2 * h + i) % 5) / 5;
            dt[t][h] = 0.1f;
        }
    /* prefill from a zero state, a checkpoint every 4 tokens and the states after the last 2 */
    int rc = mamba2_prefill_snapshots_f32(&x[0][0][0], &Bk[0][0][0], &C[0][0][0], &dt[0][0], A_log, A, D,
                                          &S[0][0][0], &y[0][0][0], 4, &ckpt[0][0][0][0], 2, &last[0][0][0][0],
                                          1, T, H, 2);
    printf("prefill with snapshots: %d\n", rc);
    /* checkpoint 0 is the state after the first 4 tokens (a prefix of the same arrays) */
    rc = mamba2_prefill_f32(&x[0][0][0], &Bk[0][0][0], &C[0][0][0], &dt[0][0], A_log, A, D, &S4[0][0][0],
                            &y4[0][0][0], 1, 4, H, 1);
    printf("checkpoint 0 is the state after 4 tokens: %s\n",
           rc == 0 && !memcmp(ckpt[0], S4, sizeof S4) ? "yes" : "no");
    printf("the last snapshot is the final state: %s\n", !memcmp(last[1], S, sizeof S) ? "yes" : "no");
    /* continuous batching: the prompt's state in slot 2, a new request in slot 0 (zeros) */
    memcpy(pool[2], S, sizeof S);
    memcpy(before, pool, sizeof pool);
    for (int n = 0; n < N; ++n)
        for (int h = 0; h < H; ++h) {
            for (int i = 0; i < DV; ++i) tx[n][h][i] = 0.25f * (float)(n + 1);
            for (int i = 0; i < DK; ++i) tB[n][h][i] = tC[n][h][i] = 0.5f;
            tdt[n][h] = 0.2f;
        }
    const int64_t slots[N] = {2, 0};
    rc = mamba2_step_slots_f32(&tx[0][0][0], &tB[0][0][0], &tC[0][0][0], &tdt[0][0], A_log, A, D,
                               &pool[0][0][0][0], &ty[0][0][0], slots, N, P, H, 2);
    printf("slot-pool step: %d\n", rc);
    printf("slots 1 and 3 untouched: %s\n",
           !memcmp(pool[1], before[1], sizeof pool[1]) && !memcmp(pool[3], before[3], sizeof pool[3]) ? "yes" : "no");
    const int64_t twice[N] = {2, 2};
    rc = mamba2_step_slots_f32(&tx[0][0][0], &tB[0][0][0], &tC[0][0][0], &tdt[0][0], A_log, A, D,
                               &pool[0][0][0][0], &ty[0][0][0], twice, N, P, H, 2);
    printf("the same slot twice: %d (MAMBA2_ERR_ARGUMENT is %d)\n", rc, MAMBA2_ERR_ARGUMENT);
    return 0;
}
