from softtopk_fairseq.pipeline.run import main

main()
