"""The Hub side: converting BERT/DistilBERT checkpoints to BertPkm (`conversion`), model cards (`model_card`, and
`card_command`: the command line a card shows, without secrets), the upload list, the push and a folder's quantized
copy (`upload`), and refreshing the code files of a saved folder (`refresh`). Not imported by the remote-code files."""
